"""A tree's shape: its size and ends, checked without compiling it.

What vLLM's front end admits (integrations/vllm/tree/admission.py) and its admission process
computes (admission_process.py): a tree's text or file parsed and checked with the loaders the
compile uses (well-formed JSON, the model's token ids, the operator's byte, node and depth limits),
and only its start and end tokens and its size kept. Numpy and the loaders only, no vLLM, so the
admission process imports this module alone.

`parse_job(Job(...))` -> `TreeShape`, or ValueError naming the problem.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from .limits import TreeLimits

__all__ = ["Job", "TreeShape", "parse_job"]


class TreeShape(NamedTuple):
    """What the front end knows of an admitted tree (no compiled data)."""

    start_token_id: int | None  # a prefix dict's; None for a trie
    end_token_id: int
    nodes: int  # as the operator's limits count them (structured.tree.loaders.TreeSize)
    depth: int


class Job(NamedTuple):
    """One tree to parse and check, as the admission process takes it (picklable)."""

    kind: str  # "tree_decode" or "token_trie"
    source: Any  # the JSON text (bytes), the operator's file (a Path) or a parsed dict / list
    path: str | None  # a token trie's descriptor
    model_id: str | None
    end: int | None  # a token trie's end token
    vocab_size: int
    limits: TreeLimits


def _shape(kind: str, obj: Any, request: Any, end: int | None, vocab_size: int, limits: TreeLimits) -> TreeShape:
    import numpy as np

    from .loaders import parse_prefix_dict, parse_sequences, parse_token_trie, prefix_dict_size, sequences_size

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


def parse_job(job: Job) -> TreeShape:
    """The shape of `job`'s tree, or ValueError naming the problem (the text beyond the byte limit,
    malformed JSON, a bad token id, a tree beyond the node or depth limit)."""
    from .loaders import parse_json_bytes, read_json_source

    what = "prefix dict config" if job.kind == "tree_decode" else "token trie payload"
    obj, raw, where = read_json_source(job.source, what, job.limits)
    return _shape(job.kind, obj if raw is None else parse_json_bytes(raw, where), job, job.end, job.vocab_size, job.limits)
