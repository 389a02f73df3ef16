"""A tree's shape: its size and ends, checked without compiling it.

What vLLM's front end admits (integrations/vllm/tree/admission.py) and its admission process
computes (admission_process.py): a tree's text or file parsed and checked with the loaders the
compile uses (well-formed JSON, the model's token ids, the operator's byte, node and depth limits),
and only its start and end tokens and its size kept. Numpy and the loaders only, no vLLM, so the
admission process imports this module alone.

`parse_job(Job(...))` -> `TreeShape`, or ValueError naming the problem. `parse_arrays(job)` ->
the parsed tree as numpy arrays alone (`compact`: a SequenceSpec without leaf names, a
PrefixDictSpec whose keys are one text), what vLLM's engine builds the trie from after its
admission process has parsed a large text (integrations/vllm/tree/compile.py): such a form pickles
as a few buffers, where the parsed JSON would be millions of objects.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from .limits import TreeLimits

__all__ = ["JoinedKeys", "Job", "TreeShape", "compact", "parse_arrays", "parse_job"]


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
    arrays: bool = False  # the admission process answers parse_arrays(job), not parse_job(job)


def _shape(kind: str, obj: Any, request: Any, end: int | None, vocab_size: int, limits: TreeLimits) -> tuple[TreeShape, Any]:
    """The tree's shape and its parsed form (loaders' PrefixDictSpec or SequenceSpec)."""
    import numpy as np

    from .loaders import parse_prefix_dict, parse_sequences, parse_token_trie, prefix_dict_size, sequences_size

    if kind == "tree_decode":
        spec = parse_prefix_dict(obj, vocab_size)
        size = prefix_dict_size(spec)  # as the compile counts it (TreeDFA.from_prefix_dict)
        limits.check_size(size, "prefix dict")
        return TreeShape(spec.start_token_id, spec.end_token_id, *size), spec
    trie = parse_token_trie(obj, path=request.path, model_id=request.model_id)
    lengths = np.fromiter((len(seq) if isinstance(seq, (list, tuple)) else 0 for seq in trie.sequences),
                          np.int64, len(trie.sequences))
    size = sequences_size(lengths)  # as the compile counts it (TreeDFA.from_token_trie)
    # Checked before the tokens are flattened and checked one by one.
    limits.check_size(size, "token trie")
    spec = parse_sequences(trie.sequences, end, vocab_size, trie.names,
                           what=f"token trie payload (model {trie.model_id!r}, path {trie.path!r})")
    return TreeShape(None, end, *size), spec


def _parsed(job: Job) -> tuple[TreeShape, Any]:
    from .loaders import parse_json_bytes, read_json_source

    what = "prefix dict config" if job.kind == "tree_decode" else "token trie payload"
    obj, raw, where = read_json_source(job.source, what, job.limits)
    return _shape(job.kind, obj if raw is None else parse_json_bytes(raw, where), job, job.end, job.vocab_size, job.limits)


def parse_job(job: Job) -> TreeShape:
    """The shape of `job`'s tree, or ValueError naming the problem (the text beyond the byte limit,
    malformed JSON, a bad token id, a tree beyond the node or depth limit)."""
    return _parsed(job)[0]


def parse_arrays(job: Job) -> Any:
    """`job`'s tree parsed and checked as `parse_job` checks it, in its `compact` form."""
    return compact(_parsed(job)[1])


class JoinedKeys(Sequence):
    """A prefix dict's keys as one text and their offsets: a sequence of str, read only where a
    message quotes a key (prefix_dict_graph's unreachable examples), pickled as two buffers."""

    def __init__(self, keys: Sequence[str]) -> None:
        import numpy as np

        encoded = [key.encode("utf-8", "surrogatepass") for key in keys]
        self._text = b"".join(encoded)
        self._offsets = np.zeros(len(encoded) + 1, np.int64)
        np.cumsum([len(key) for key in encoded], out=self._offsets[1:])

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # negative indices, and IndexError past the end
        return self._text[self._offsets[i]:self._offsets[i + 1]].decode("utf-8", "surrogatepass")


def compact(spec: Any) -> Any:
    """A parsed tree without its Python objects: a SequenceSpec's leaf names dropped (they only name
    a bad leaf, and the tree is checked), a PrefixDictSpec's keys joined (JoinedKeys)."""
    import dataclasses

    from .loaders import SequenceSpec

    if isinstance(spec, SequenceSpec):
        return dataclasses.replace(spec, names=None)
    return dataclasses.replace(spec, keys=JoinedKeys(spec.keys))
