"""The process that parses large trees for vLLM's front end and engine, so that neither holds
Python's GIL for the seconds a large tree's parse takes.

`json.loads` of a 40 MB token trie builds millions of lists and ints in one C call that never
releases the GIL, so a worker thread would stall the API server's event loop as surely as parsing
on it (measured: a 51 MB trie admitted in a thread held a 1 ms asyncio ticker for 5.7 s), and the
engine core's compile thread stalled every stream's steps the same way (issue 36, defect 3). Here
the process sends the text (or the operator's file's path) down a pipe and waits for the answer:
the front end a few integers (a TreeShape), the engine the parsed tree as a few numpy arrays
(shape.parse_arrays, a job with `arrays`) that it builds the trie from. Reading and writing a pipe
release the GIL, and the parsed objects (hundreds of MB for such a tree) never exist in vLLM's
processes.

`parse_in_process(job)` -> the TreeShape or the arrays, or ValueError naming the problem. One
process per vLLM process that needs one (the API server, the engine core), started by its first
large tree (`python -m` this module: logitgate's tree loaders through structured/tree/shape.py,
no vLLM), one parse at a time, ended when its parent closes its pipe (the parent exits or dies) and
started again after it ends. Messages are pickles framed by their length.
"""
from __future__ import annotations

import gc
import hashlib
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import IO, Any

from ....structured.tree.shape import Job, parse_arrays, parse_job

__all__ = ["INLINE_MAX_BYTES", "encoded_chunks", "measured_text", "parse_in_process"]

INLINE_MAX_BYTES = 1 << 16  # larger texts and files are parsed in the admission process (~5 ms here)

_LENGTH = struct.Struct("<Q")
_CHUNK_CHARS = 1 << 18  # a str text is encoded and written this many characters at a time
# A child of vLLM's logger, so that the start shows in vLLM's log.
logger = logging.getLogger("vllm.logitgate")


def _send(stream: IO[bytes], data: bytes) -> None:
    stream.write(_LENGTH.pack(len(data)))
    stream.write(data)  # a large write releases the GIL


def _receive(stream: IO[bytes]) -> bytes:
    """The next frame, or EOFError when the other side has closed its end."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError("the pipe closed")
    (length,) = _LENGTH.unpack(head)
    data = stream.read(length)
    if len(data) < length:
        raise EOFError("the pipe closed mid-message")
    return data


def encoded_chunks(text: str) -> Iterator[bytes]:
    """`text` as UTF-8 (lone surrogates passed through, as the loaders read it), a slice at a time:
    the whole text encoded at once is a buffer as large as the tree, allocated on the thread that
    encodes it, and glibc keeps such buffers in that thread's arena after they are freed (a
    front end's RSS grew by 1.2 GB over 20 tries, issue 36 defect 5)."""
    for start in range(0, len(text), _CHUNK_CHARS):
        yield text[start:start + _CHUNK_CHARS].encode("utf-8", "surrogatepass")


def measured_text(text: str, what: str, limits: Any) -> tuple[int, str]:
    """(UTF-8 length, hash) of a JSON text, encoded a slice at a time (never whole in this thread:
    encoded_chunks); TreeTooLarge beyond the byte limit, as read_json_source."""
    if len(text) > limits.max_bytes:  # a char is at least a byte: no need to encode
        limits.check_bytes(len(text), what)
    digest, size = hashlib.blake2b(digest_size=20), 0
    for chunk in encoded_chunks(text):
        digest.update(chunk)
        size += len(chunk)
    limits.check_bytes(size, what)
    return size, digest.hexdigest()


def _send_job(stream: IO[bytes], job: Any, text_bytes: int | None = None) -> None:
    """A job is its pickle without its text, then the text as a frame of its own: pickling 40 MB
    would copy them once more while holding the GIL. A str text (JSON, `text_bytes` long in UTF-8)
    is encoded a slice at a time as it is written."""
    text = job.source if isinstance(job.source, (bytes, str)) else None
    _send(stream, pickle.dumps(job._replace(source=None) if text is not None else job, pickle.HIGHEST_PROTOCOL))
    if isinstance(text, bytes):
        _send(stream, text)
    elif text is not None:
        if text_bytes is None:
            text_bytes = sum(map(len, encoded_chunks(text)))
        stream.write(_LENGTH.pack(text_bytes))
        for chunk in encoded_chunks(text):
            stream.write(chunk)
    stream.flush()


def _receive_job(stream: IO[bytes]) -> Any:
    job = pickle.loads(_receive(stream))
    return job._replace(source=_receive(stream)) if job.source is None else job


class _Process:
    """The child process and the pipe to it; one parse at a time (a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None

    def _started(self) -> subprocess.Popen:
        if self._child is None or self._child.poll() is not None:
            # The child's stdout is the reply pipe; its stderr is the server's (log lines go there).
            self._child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, close_fds=True)
            logger.info("logitgate tree admission process started (pid %d, for pid %d): large trees are parsed "
                        "there, off this process's GIL", self._child.pid, os.getpid())
        return self._child

    def _exit_status(self) -> int | None:
        """The child's exit status once it has closed its pipe (it is exiting), or None."""
        try:
            return self._child.wait(timeout=5) if self._child is not None else None
        except subprocess.TimeoutExpired:
            return None

    def _end(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.wait()

    def parse(self, job: Any, text_bytes: int | None = None) -> Any:
        with self._lock:
            try:
                child = self._started()
                _send_job(child.stdin, job, text_bytes)
                ok, value = pickle.loads(_receive(child.stdout))
            except (OSError, EOFError, pickle.UnpicklingError) as err:
                code = self._exit_status()
                self._end()
                ended = f"exit status {code}" if code is not None else str(err)
                raise ValueError(f"the tree could not be parsed: logitgate's tree admission process ended ({ended}); "
                                 "send it again") from None
        if not ok:
            raise ValueError(value)
        return value


_process = _Process()


def parse_in_process(job: Job, text_bytes: int | None = None) -> Any:
    """`parse_job(job)` (structured/tree/shape.py), or `parse_arrays(job)` for a job with `arrays`,
    run in the admission process; its ValueError is raised here with the same message. A str
    source is JSON text (`text_bytes`: its UTF-8 length, when known). A process that ends mid-parse
    (killed, out of memory) fails this parse with a ValueError that says so; the next parse starts
    a new one."""
    return _process.parse(job, text_bytes)


def _serve(requests: IO[bytes], replies: IO[bytes]) -> None:
    while True:
        try:
            job = _receive_job(requests)
        except EOFError:
            return
        try:
            reply: tuple[bool, Any] = (True, parse_arrays(job) if job.arrays else parse_job(job))
        except ValueError as err:
            reply = (False, str(err))
        except RecursionError:
            reply = (False, "the tree is nested too deeply to be parsed")
        del job
        _send(replies, pickle.dumps(reply, pickle.HIGHEST_PROTOCOL))
        replies.flush()
        gc.collect()  # the parsed tree's objects go before the next one arrives


def main() -> None:
    # Ctrl-C in the server's terminal reaches this process too: it ends when the server closes the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Replies go to the original stdout alone: anything a library prints goes to stderr instead.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
