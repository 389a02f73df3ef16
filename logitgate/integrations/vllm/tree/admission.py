"""Admission of a tree request in vLLM's front end: is the tree well formed, made of the model's
token ids and within the operator's size limits? The tree is parsed, never compiled: the front end
keeps no compiled tree (the engine compiles it, once), and the cost is one linear, vectorised parse
(structured/tree/shape.py over structured/tree/loaders.py), bounded by the byte limit.

The limits are the operator's tree limits (logitgate/structured/tree/limits.py: LOGITGATE_TREE_MAX_BYTES,
_NODES, _DEPTH), the same that bound every tree the library builds; beyond one, TreeTooLarge (a
ValueError: HTTP 400) names the value, the limit and the variable. Bytes are measured by the same
reader and nodes and depth counted by the same functions (structured.tree.loaders.TreeSize) as in the engine's
compile, so a tree admitted here never fails the engine's own checks.

`admit(request, vocab_size, eos_token_id)` -> `TreeShape` or ValueError naming the problem.

Off the event loop: vLLM's OpenAI server calls `InputProcessor.process_inputs`, and so `admit`, on
its event loop, where a 40 MB tree's parse held every other client (/health included) for seconds.
`admission` (awaited by the `AsyncLLM.add_request` replacement in route.py, before
process_inputs) runs `admit` on a worker thread, with every text or operator's file larger than
INLINE_MAX_BYTES parsed in the admission process (admission_process.py: a parse holds the GIL,
so a thread alone would not free the loop); `handed_over(admission)` gives the outcome to the
`admit` that process_inputs then calls in the same task, which returns it instead of parsing again.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from ....json_text import is_json_text
from ....structured.tree.limits import TreeLimits
from ....structured.tree.shape import Job, TreeShape, parse_job
from .admission_process import INLINE_MAX_BYTES, measured_text, parse_in_process

__all__ = ["Admission", "Job", "TreeShape", "admission", "admit", "handed_over", "parse_job"]

_ADMITTED_MAX = 256  # tree shapes remembered (a few ints each), so a tree sent again is not parsed again


def _admitted_cache() -> Any:
    global _ADMITTED
    if _ADMITTED is None:
        from ....structured.compile_cache import LRUCache

        _ADMITTED = LRUCache(_ADMITTED_MAX)
    return _ADMITTED


_ADMITTED = None


def _parse(job: Job, size: int) -> TreeShape:
    if size <= INLINE_MAX_BYTES:
        return parse_job(job)
    return parse_in_process(job, size if isinstance(job.source, str) else None)


def _what(kind: str) -> str:
    return "prefix dict config" if kind == "tree_decode" else "token trie payload"


def _admit(request: Any, vocab_size: int, end: int | None, limits: TreeLimits) -> TreeShape:
    from ....structured.compile_cache import content_hash
    from ....structured.tree.loaders import read_json_source

    job = Job(request.kind, request.source, request.path, request.model_id, end, vocab_size, limits)
    if isinstance(request.source, (dict, list)):  # from an in-process caller: parsed as it is, no cache
        return parse_job(job)
    if isinstance(request.source, os.PathLike):  # the operator's: known by its size and time, read when new
        stat = Path(request.source).stat()
        key: Any = ("file", str(request.source), stat.st_mtime_ns, stat.st_size)
        size = stat.st_size
    elif isinstance(request.source, str) and is_json_text(request.source):  # a client's text, known by its hash
        size, digest = measured_text(request.source, _what(job.kind), limits)
        key = ("text", digest)
    else:  # bytes (an in-process caller's) or a path given as a str: within the limit, known by its hash
        _, raw, _ = read_json_source(request.source, _what(job.kind), limits)
        job, key, size = job._replace(source=raw), ("bytes", content_hash(raw)), len(raw)
    key = (*key, job.kind, *job[2:])  # what decides the outcome besides the text
    return _admitted_cache().get_or_create(key, lambda: _parse(job, size))


class Admission(NamedTuple):
    """A request's tree, admitted ahead of vLLM's `process_inputs` (see `admission`)."""

    request: Any  # the TreeRequest, with the vocabulary size, end token and limits it was admitted for
    vocab_size: int
    end: int | None
    limits: TreeLimits
    shape: TreeShape | None
    error: ValueError | None


_handed_over: contextvars.ContextVar[Admission | None] = contextvars.ContextVar("logitgate_tree_admission", default=None)


@contextlib.contextmanager
def handed_over(done: Admission | None) -> Iterator[None]:
    """While this is open, `admit` in this task (asyncio) or thread returns `done`'s outcome for
    the same tree, end token, vocabulary and limits instead of parsing again."""
    token = _handed_over.set(done)
    try:
        yield
    finally:
        _handed_over.reset(token)


def admit(request: Any, vocab_size: int, eos_token_id: int | None, limits: TreeLimits | None = None) -> TreeShape:
    """Check a resolved `TreeRequest` (args.tree_request_for) as the engine would compile it,
    without compiling; the operator's files are checked once per content (size and mtime), inline
    JSON text once per content hash. ValueError names the extra_args key and the problem."""
    kind = request.kind
    end = request.end_token(vocab_size, eos_token_id)  # its message names the key already
    done = _handed_over.get()
    try:
        limits = limits or TreeLimits.from_env()
        if done is None or done[:4] != (request, vocab_size, end, limits):
            return _admit(request, vocab_size, end, limits)
    except OSError as err:  # the operator's file vanished between lookup and stat
        raise ValueError(f"extra_args[{kind!r}]: the tree file cannot be read ({err.strerror})") from None
    except ValueError as err:
        raise ValueError(f"extra_args[{kind!r}]: {err}") from None
    shape, error = done.shape, done.error
    # A raise keeps this frame (its traceback): it must not hold the admission, whose request holds
    # the tree text, nor raise the admission's own error (error -> traceback -> frame -> done ->
    # error is a cycle, freed only by a full GC; issue 36, defect 5). A new error, same message.
    del done
    if error is not None:
        raise ValueError(str(error)) from None  # already says which key
    return shape


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MAPPED_MIN_BYTES = 4 << 20  # buffers this large are mapped, and unmapped when freed
_mapped = False


def _large_buffers_returned() -> None:
    """Once per process (the API server, at its first tree): glibc maps every buffer of
    MAPPED_MIN_BYTES or more, so it goes back to the system when freed. By default the threshold
    grows with the buffers freed, up to 32 MB, and a 30 MB request body is then carved from a heap:
    while tree requests wait for their admission, several bodies are alive at once, and what they
    leave is heap the allocator keeps (the API server stayed +1.2 GB after 20 concurrent 30-40 MB
    tries; issue 36, defect 5). Nothing happens where the C library is not glibc."""
    global _mapped
    if _mapped:
        return
    _mapped = True
    try:
        _libc().mallopt(_M_MMAP_THRESHOLD, MAPPED_MIN_BYTES)
    except (OSError, AttributeError):
        pass


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None)


# After the last large tree's admission (a second trim 10 s later gave nothing more: +463 MB
# after 20 concurrent 31 MB tries against +431 MB with this one alone).
TRIM_AFTER_S = (1.0,)
_trims: list[asyncio.TimerHandle] = []


def _heaps_trimmed_later() -> None:
    """After a large tree's admission (on the event loop): once no other large tree has been
    admitted for each of TRIM_AFTER_S, glibc's malloc_trim(0) on a worker thread gives the heaps'
    free pages back to the system. A large body arrives in many small pieces, which concurrent
    uploads interleave on the heap; the pieces are free once the body is joined, but the pages they
    leave between live objects stay with the process (+630 MB after 20 concurrent 35 MB tries)."""
    for trim in _trims:
        trim.cancel()
    loop = asyncio.get_running_loop()
    _trims[:] = [loop.call_later(delay, lambda: loop.run_in_executor(None, _trimmed)) for delay in TRIM_AFTER_S]


def _trimmed() -> None:
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


async def admission(request: Any, vocab_size: int, eos_token_id: int | None,
                    limits: TreeLimits | None = None) -> Admission | None:
    """`admit` on a worker thread (its parse, for a large tree, in the admission process), as an
    Admission for `handed_over`; None where `admit` would fail before parsing (no end token, a
    malformed limit variable): process_inputs then says why itself."""
    _large_buffers_returned()
    try:
        end = request.end_token(vocab_size, eos_token_id)
        limits = limits or TreeLimits.from_env()
    except ValueError:
        return None
    try:
        shape = await asyncio.to_thread(admit, request, vocab_size, eos_token_id, limits)
    except ValueError as err:  # its message alone: its traceback's frames hold the tree text
        return Admission(request, vocab_size, end, limits, None, ValueError(str(err)))
    finally:
        if isinstance(request.source, (str, bytes)) and len(request.source) > INLINE_MAX_BYTES:
            _heaps_trimmed_later()
    return Admission(request, vocab_size, end, limits, shape, None)
