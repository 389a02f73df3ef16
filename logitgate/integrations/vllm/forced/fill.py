"""A batch with drafts filled as vLLM fills one without: in parallel where vLLM's manager would be.

vLLM's StructuredOutputManager.grammar_bitmask fills a batch with drafts one request at a time (its
draft-aware path: a row per draft, each grammar advanced by its drafts and rolled back), and fills
a batch without drafts on its pool once the batch exceeds `fill_bitmask_parallel_threshold` (128;
`fill` lowers it to 1 on CPU engines). Forced drafts put drafts in batches that had none, so every
structured request of such a step would fill serially. Here:

- the requests without drafts take vLLM's own fill (its parallel path where its rule says so);
- the requests with drafts take vLLM's own draft-aware fill, run on contiguous shards of them in
  parallel on the manager's pool, under the same rule: each shard is a shallow copy of the manager
  with a bitmask of its own and the parallel path off, so vLLM's code writes that shard's rows;
- the rows are put back in vLLM's layout (per request in batch order: its draft rows, then its
  bonus row).

Called by the manager's grammar_bitmask replacement (sample_first/scheduler.py, installed with
`sample_first`, the default everywhere; off the CPU it defers no row). Under a user's drafter vLLM
fills every batch serially (its parallel path needs no speculative config): there the whole batch,
drafted or not, goes to the shards. Where it is not installed
(`LOGITGATE_VLLM_OPS` without sample_first), forced/scheduler.py turns vLLM's parallel fill off
while drafts run, so vLLM's own serial path fills them. Requests' grammars are distinct objects, so shards never touch the same grammar; xgrammar's and
llguidance's fills release the GIL.
"""
from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ....cores import usable_cores
from ..patching import is_replacement, unwrapped

__all__ = ["fill_drafted", "filled_rows", "fixed_blocks", "grammar_bitmask", "mask_stride", "new_bitmask", "row_layout"]

_SHARD_BITMASKS = "_logitgate_shard_bitmasks"  # one bitmask per shard, grown as batches need


def new_bitmask(manager: Any, rows: int) -> Any:
    """A fresh all-ones bitmask of `rows` rows in the manager's backend's layout (int32 words of
    32 tokens); only tree requests (no backend): the layout the tree route allocates."""
    if manager.backend is not None:
        return manager.backend.allocate_token_bitmask(rows)
    from ..tree.route import all_ones_bitmask

    return all_ones_bitmask(manager.vllm_config, rows)


def _shard_bitmask(manager: Any, index: int, rows: int) -> Any:
    """Shard `index`'s bitmask, of at least `rows` rows (taken in the calling thread, before the shards run)."""
    bitmasks = manager.__dict__.setdefault(_SHARD_BITMASKS, [])
    while len(bitmasks) <= index:
        bitmasks.append(None)
    if bitmasks[index] is None or bitmasks[index].shape[0] < rows:
        bitmasks[index] = new_bitmask(manager, rows)
    return bitmasks[index]


def _shards(ids: list[str], rows: list[int], count: int) -> list[tuple[list[str], int]]:
    """`ids` cut into at most `count` contiguous runs of about equal rows; (ids, rows) each."""
    target = sum(rows) / count
    out: list[tuple[list[str], int]] = []
    run: list[str] = []
    run_rows = done = 0
    for req_id, n in zip(ids, rows):
        run.append(req_id)
        run_rows += n
        if len(out) < count - 1 and done + run_rows >= target * (len(out) + 1):
            out.append((run, run_rows))
            done += run_rows
            run, run_rows = [], 0
    if run:
        out.append((run, run_rows))
    return out


def _fill_shard(original: Callable, manager: Any, bitmask: Any, requests: Any, ids: list[str], spec: dict) -> np.ndarray:
    shard = copy.copy(manager)  # per call: the manager's attributes (its backend) may change between steps
    shard._grammar_bitmask = bitmask
    shard.fill_bitmask_parallel_threshold = sys.maxsize  # vLLM's serial, draft-aware path
    return original(shard, requests, ids, spec)


@functools.cache
def fixed_blocks(original: Callable | None = None) -> bool:
    """Whether this vLLM's StructuredOutputManager.grammar_bitmask (`original`, else vLLM's own)
    gives each request a block of a fixed number of rows (vLLM 0.33: num_speculative_tokens + 1,
    its drafts' rows first, the rest unused) rather than its rows alone, one after the other
    (vLLM 0.32). Read from the function's local names (no source needed): 0.33's has `mask_stride`."""
    if original is None:
        try:
            from vllm.v1.structured_output import StructuredOutputManager
        except ImportError:  # no engine here to lay rows (vLLM's interface alone)
            return False
        original = StructuredOutputManager.grammar_bitmask
    while is_replacement(original):  # (logitgate's replacement of it is not vLLM's code)
        original = unwrapped(original)
    code = getattr(original, "__code__", None)
    return code is not None and "mask_stride" in code.co_varnames


def mask_stride(original: Callable, config: Any) -> int | None:
    """Rows per request block in the bitmask `original` fills under `config` (as vLLM computes
    it), or None where its rows are laid one request after another (fixed_blocks)."""
    if not fixed_blocks(original):
        return None
    diffusion = bool(getattr(getattr(config, "model_config", None), "is_diffusion", False))
    return int(config.num_speculative_tokens or 0) + (0 if diffusion else 1)


def fill_drafted(original: Callable, manager: Any, requests: Any, ids: list[str], spec: dict) -> np.ndarray:
    """vLLM's draft-aware fill (`original`, StructuredOutputManager.grammar_bitmask) of `ids` with
    drafts `spec`: the rows vLLM's one serial call returns, computed on shards in parallel where
    vLLM would fill a batch of this size in parallel. Each shard's bitmask holds its requests' rows
    in vLLM's layout (a fixed block each where vLLM lays them so: mask_stride); shards are balanced
    by the rows actually filled."""
    rows = [1 + len(spec.get(req_id, ())) for req_id in ids]
    stride = mask_stride(original, manager.vllm_config)
    if stride is not None and max(rows, default=0) > stride:
        raise ValueError(f"a request has {max(rows) - 1} drafts, more than this vLLM's bitmask holds per request "
                         f"({stride - 1}: num_speculative_tokens)")

    def size(shard_ids: list[str], shard_rows: int) -> int:
        return shard_rows if stride is None else len(shard_ids) * stride

    pool = getattr(manager, "executor_for_fillmask", None)  # vLLM's, or fill_ahead's (one thread per core)
    workers = usable_cores() if pool is not None else 1
    if len(ids) <= manager.fill_bitmask_parallel_threshold or workers < 2 or len(ids) < 2:
        bitmask = _shard_bitmask(manager, 0, size(ids, sum(rows)))
        return _fill_shard(original, manager, bitmask, requests, ids, spec).copy()
    shards = _shards(ids, rows, min(workers, len(ids)))
    bitmasks = [_shard_bitmask(manager, index, size(*shard)) for index, shard in enumerate(shards)]
    futures = [pool.submit(_fill_shard, original, manager, bitmask, requests, shard_ids, spec)
               for bitmask, (shard_ids, _) in zip(bitmasks, shards)]
    return np.concatenate([future.result() for future in futures])  # copies: the shards' buffers are reused


def row_layout(ids: list[str], drafted: dict,
               stride: int | None = None) -> tuple[int, Callable[[list[str], set], list[int]]]:
    """vLLM's layout of a batch's bitmask (per request in batch order: a row per draft, then the
    bonus row; in a block of `stride` rows each where vLLM lays them so, mask_stride): the row
    count, and `rows_of(subset, without_bonus)`, the rows of `subset`'s requests in batch order
    (their bonus rows left out for the requests in `without_bonus`)."""
    if stride is None:
        ends = np.cumsum([1 + len(drafted.get(req_id, ())) for req_id in ids]).tolist()
    else:
        ends = [i * stride + 1 + len(drafted.get(req_id, ())) for i, req_id in enumerate(ids)]
    end_of = dict(zip(ids, ends))

    def rows_of(subset: list[str], without_bonus: set = frozenset()) -> list[int]:
        return [row for req_id in subset for row in range(end_of[req_id] - 1 - len(drafted.get(req_id, ())),
                                                          end_of[req_id] - (req_id in without_bonus))]

    if stride is not None:
        return len(ids) * stride, rows_of
    return (ends[-1] if ends else 0), rows_of


def filled_rows(filled: np.ndarray, ids: list[str], spec: dict, stride: int | None) -> np.ndarray:
    """The rows of `filled` (a fill of `ids` with drafts `spec` in vLLM's layout) that hold a mask,
    in order: all of them, or, in blocks of `stride` rows, the used head of each block."""
    if stride is None:
        return filled
    return filled[row_layout(ids, spec, stride)[1](ids)]


def grammar_bitmask(original: Callable, manager: Any, requests: Any, ids: list[str], drafted: dict,
                    fill_plain: Callable[[list[str]], Any]) -> Any:
    """The bitmask vLLM's `original` returns for the batch, with the requests without drafts filled
    by `fill_plain(ids)` (vLLM's own fill, timed by the caller) and those with drafts by `fill_drafted`."""
    with_drafts = [req_id for req_id in ids if drafted.get(req_id)]
    if not with_drafts:
        return fill_plain(ids)
    if len(with_drafts) == len(ids):
        return fill_drafted(original, manager, requests, ids, drafted)
    stride = mask_stride(original, manager.vllm_config)
    total, rows_of = row_layout(ids, drafted, stride)
    plain = [req_id for req_id in ids if not drafted.get(req_id)]
    filled_plain = fill_plain(plain)
    bitmask = np.full((total, filled_plain.shape[1]), -1, dtype=filled_plain.dtype)  # (a block's unused rows: all-ones)
    bitmask[rows_of(plain)] = filled_rows(filled_plain, plain, {}, stride)
    drafted_rows = fill_drafted(original, manager, requests, with_drafts, drafted)
    bitmask[rows_of(with_drafts)] = filled_rows(drafted_rows, with_drafts, drafted, stride)
    return bitmask
