"""Admission of a tree request in vLLM's front end: is the tree well formed, made of the model's
token ids and within the operator's size limits? The tree is parsed, never compiled: the front end
keeps no compiled tree (the engine compiles it, once), and the cost is one linear, vectorised parse
(tree_loaders), bounded by the byte limit.

The limits are the operator's tree limits (logitgate/tree_limits.py: LOGITGATE_TREE_MAX_BYTES,
_NODES, _DEPTH), the same that bound every tree the library builds; beyond one, TreeTooLarge (a
ValueError: HTTP 400) names the value, the limit and the variable. Bytes are measured by the same
reader and nodes and depth counted by the same functions (tree_loaders.TreeSize) as in the engine's
compile, so a tree admitted here never fails the engine's own checks.

`admit(request, vocab_size, eos_token_id)` -> `TreeShape` or ValueError naming the problem.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

from ...tree_limits import TreeLimits

__all__ = ["TreeShape", "admit"]

_ADMITTED_MAX = 256  # tree shapes remembered (a few ints each), so a tree sent again is not parsed again


class TreeShape(NamedTuple):
    """What the front end knows of an admitted tree (no compiled data)."""

    start_token_id: int | None  # a prefix dict's; None for a trie
    end_token_id: int
    nodes: int  # as the operator's limits count them (tree_loaders.TreeSize)
    depth: int


def _admitted_cache() -> Any:
    global _ADMITTED
    if _ADMITTED is None:
        from ...structured.compile_cache import LRUCache

        _ADMITTED = LRUCache(_ADMITTED_MAX)
    return _ADMITTED


_ADMITTED = None


def _shape(kind: str, obj: Any, request: Any, end: int | None, vocab_size: int, limits: TreeLimits) -> TreeShape:
    import numpy as np

    from ...structured.tree_loaders import (
        parse_prefix_dict,
        parse_sequences,
        parse_token_trie,
        prefix_dict_size,
        sequences_size,
    )

    if kind == "tree_decode":
        spec = parse_prefix_dict(obj, vocab_size)
        size = prefix_dict_size(spec)  # as the compile counts it (TreeDFA.from_prefix_dict)
        limits.check_size(size, "prefix dict")
        return TreeShape(spec.start_token_id, spec.end_token_id, *size)
    trie = parse_token_trie(obj, path=request.path, model_id=request.model_id)
    lengths = np.fromiter((len(seq) if isinstance(seq, (list, tuple)) else 0 for seq in trie.sequences),
                          np.int64, len(trie.sequences))
    size = sequences_size(lengths)  # as the compile counts it (TreeDFA.from_token_trie)
    # Checked before the tokens are flattened and checked one by one.
    limits.check_size(size, "token trie")
    parse_sequences(trie.sequences, end, vocab_size, trie.names,
                    what=f"token trie payload (model {trie.model_id!r}, path {trie.path!r})")
    return TreeShape(None, end, *size)


def admit(request: Any, vocab_size: int, eos_token_id: int | None, limits: TreeLimits | None = None) -> TreeShape:
    """Check a resolved `TreeRequest` (tree_args.tree_request_for) as the engine would compile it,
    without compiling; the operator's files are checked once per content (size and mtime), inline
    JSON text once per content hash. ValueError names the extra_args key and the problem."""
    from ...structured.compile_cache import content_hash
    from ...structured.tree_loaders import parse_json_bytes, read_json_source

    kind = request.kind
    end = request.end_token(vocab_size, eos_token_id)  # its message names the key already
    try:
        operator_file = isinstance(request.source, os.PathLike)
        if operator_file:
            stat = Path(request.source).stat()
            key: Any = ("file", str(request.source), stat.st_mtime_ns, stat.st_size)
        limits = limits or TreeLimits.from_env()
        obj, raw, where = read_json_source(
            request.source, "prefix dict config" if kind == "tree_decode" else "token trie payload", limits)
        if raw is None:  # a dict from an in-process caller: parse it, no cache
            return _shape(kind, obj, request, end, vocab_size, limits)
        if not operator_file:
            key = ("text", content_hash(raw))
        key = (*key, kind, vocab_size, end, request.path, request.model_id, limits)
        return _admitted_cache().get_or_create(
            key, lambda: _shape(kind, parse_json_bytes(raw, where), request, end, vocab_size, limits)
        )
    except OSError as err:  # the operator's file vanished between lookup and stat
        raise ValueError(f"extra_args[{kind!r}]: the tree file cannot be read ({err.strerror})") from None
    except ValueError as err:
        raise ValueError(f"extra_args[{kind!r}]: {err}") from None
