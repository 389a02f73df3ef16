"""The engine's compile of a tree request, with a large tree's parse off the engine core's GIL.

vLLM's engine core compiles a tree on a worker thread (route.py), but `json.loads` of a large
text and the per-leaf checks hold Python's GIL for seconds (1.4 s of a 35 MB trie's 3 s compile),
which stopped every stream's steps (issue 36, defect 3). So a text or operator's file larger than
INLINE_MAX_BYTES is parsed and checked in the admission process (admission_process.py, the same
parse as the front end's admission, structured/tree/shape.py), which answers with the tree as a
few numpy arrays; the trie is built from them here (`TreeDFA.from_parsed`: numpy and numba kernels
that release the GIL). Smaller trees, and trees given as parsed dicts, compile here as before.

A large tree sent again finds its compiled tree without a parse while that tree lives (in
TreeDFA's cache or in another request): the text's hash leads to it (weak references only, so
nothing here keeps a tree alive).
"""
from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ....json_text import is_json_text
from ....structured.tree.limits import TreeLimits
from ....structured.tree.shape import Job
from .admission_process import INLINE_MAX_BYTES, measured_text, parse_in_process

__all__ = ["compile_tree"]

_KNOWN_MAX = 256  # texts remembered (a hash and a weak reference each)
_known: OrderedDict[tuple, weakref.ref] = OrderedDict()
_known_lock = threading.Lock()


def _large_source(request: Any, limits: TreeLimits) -> tuple[Any, int | None, tuple] | None:
    """(what the admission process reads, a str text's UTF-8 length, a key for the text) for a text
    or file larger than INLINE_MAX_BYTES, else None (compiled in this process)."""
    from ....structured.compile_cache import content_hash
    from ....structured.tree.loaders import read_json_source

    source = request.source
    if isinstance(source, (dict, list)):
        return None
    if isinstance(source, os.PathLike):
        stat = Path(source).stat()
        if stat.st_size <= INLINE_MAX_BYTES:
            return None
        return source, None, ("file", str(source), stat.st_mtime_ns, stat.st_size)
    if isinstance(source, str) and len(source) <= INLINE_MAX_BYTES:
        return None
    what = "prefix dict config" if request.kind == "tree_decode" else "token trie payload"
    if isinstance(source, str) and is_json_text(source):  # never encoded whole here (encoded_chunks)
        size, digest = measured_text(source, what, limits)
        return (source, size, ("text", digest)) if size > INLINE_MAX_BYTES else None
    _, raw, _ = read_json_source(source, what, limits)
    if raw is None or len(raw) <= INLINE_MAX_BYTES:
        return None
    return raw, None, ("bytes", content_hash(raw))


def _remembered(key: tuple) -> Any:
    with _known_lock:
        ref = _known.get(key)
        if ref is not None:
            _known.move_to_end(key)
        return ref() if ref is not None else None


def _remember(key: tuple, tree: Any) -> None:
    with _known_lock:
        _known[key] = weakref.ref(tree)
        _known.move_to_end(key)
        while len(_known) > _KNOWN_MAX:
            _known.popitem(last=False)


def compile_tree(request: Any, vocab_size: int, eos_token_id: int | None) -> Any:
    """The TreeDFA of a resolved TreeRequest on the host (where vLLM keeps its bitmask); a large
    tree parsed in the admission process. ValueError names the extra_args key and the problem."""
    from ....structured.tree.dfa import TreeDFA

    end = request.end_token(vocab_size, eos_token_id)  # its message names the key already
    try:
        limits = TreeLimits.from_env()
        large = _large_source(request, limits)
        if large is None:
            return request.compile(vocab_size, device="cpu", eos_token_id=eos_token_id)
        source, text_bytes, text_key = large
        key = (*text_key, request.kind, request.path, request.model_id, end, vocab_size, limits)
        tree = _remembered(key)
        if tree is None:
            job = Job(request.kind, source, request.path, request.model_id, end, vocab_size, limits, arrays=True)
            tree = TreeDFA.from_parsed(parse_in_process(job, text_bytes), end_token_id=end, vocab_size=vocab_size,
                                       device="cpu", limits=limits)
            _remember(key, tree)
        return tree
    except OSError as err:  # the operator's file vanished between lookup and stat
        raise ValueError(f"extra_args[{request.kind!r}]: the tree file cannot be read ({err.strerror})") from None
    except ValueError as err:
        message = str(err)
        prefix = f"extra_args[{request.kind!r}]: "
        raise ValueError(message if message.startswith(prefix) else prefix + message) from None
