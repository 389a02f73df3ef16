"""Tree candidates: a batch's allowed tokens at a cost that follows what the tree allows, not the
vocabulary.

A decode step under a TreeDFA needs, per row, only the logits of the tokens its state allows. This
module lays a batch out for sampling in one of two layouts, chosen per row:

- sparse: row i's allowed logits gathered into columns 0..w_i-1 of an (n, W) float32 tensor, -inf
  after (column j stands for token `allow_tok[start_i + j]`; allowed tokens are sorted, so the
  first maximum is the smallest token id, as in the dense argmax);
- dense: the row's full logits masked in place (a bitmask, or -inf everywhere but the allowed
  tokens) with the identity map.

`plan_tree_step` decides. With the rows' states known on the host (the decode loop and the vLLM
processor keep them there; on CPU reading them is free) the widths are exact: rows allowing more
than `sparse_max_fraction` of the vocabulary go dense, the rest form at most two width buckets
(split where the padded size is smallest). With states on the device only, the plan must not read
them: one sparse group as wide as the tree's widest state, or dense for every row when that is
wider than the crossover. Nothing here synchronises with the device beyond what the caller gives.

The crossover (`DEFAULT_SPARSE_MAX_FRACTION`, environment `LOGITGATE_TREE_SPARSE_MAX_FRACTION`,
or the `sparse_max_fraction` argument) was measured with logitgate/bench/tree.py (docs/benchmarks.md,
"Tree decode steps"): on CPU a row is cheaper sparse until it allows about half the vocabulary.

Sampling a plan (its layouts through the Sampler, the greedy and fused shortcuts) is the sampling
layer's: logitgate.sampling.tree_sampling (`sample_tree_step`, `sample_plan`, `tree_layouts`, ...).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ... import envs
from ...backends.base import CandidateRows
from ...backends.formats import num_bitmask_words
from ...backends.transfer import to_device
from ...checks import is_integer, short_repr
from .dfa import TreeDFA

__all__ = [
    "DEFAULT_SPARSE_MAX_FRACTION",
    "DenseRows",
    "keep_only_allowed",
    "SparseRows",
    "TreeStepPlan",
    "plan_tree_step",
    "ragged_candidates",
    "resolve_sparse_max_fraction",
]

# A row allowing more than this fraction of the vocabulary is masked and sampled densely.
DEFAULT_SPARSE_MAX_FRACTION = 0.5
ENV_SPARSE_MAX_FRACTION = "LOGITGATE_TREE_SPARSE_MAX_FRACTION"
# A second width bucket must save at least this many padded values to pay for its extra launches
# (a second sampler call: ~0.1 ms on CPU, the time of ~30k values through top-p sampling).
_GROUP_COST = 32768
_MAX_ROW = 2**31 - 1  # batch rows are int32-sized everywhere (bitmasks, vLLM)


def resolve_sparse_max_fraction(value: float | None = None) -> float:
    """The crossover in force: `value`, else LOGITGATE_TREE_SPARSE_MAX_FRACTION, else the default.
    0 makes every row dense; 1 every row sparse."""
    if value is None:
        text = envs.read(ENV_SPARSE_MAX_FRACTION)
        if text is None:
            return DEFAULT_SPARSE_MAX_FRACTION
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{ENV_SPARSE_MAX_FRACTION}={text!r} is not a number in [0, 1]") from None
        where = ENV_SPARSE_MAX_FRACTION
    else:
        where = "sparse_max_fraction"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{where} must be a number in [0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SparseRows:
    """Rows of a batch in the sparse layout: (n, width) gathered logits, column j of row i is token
    allow_tok[starts[i] + j] for j < widths[i]."""

    tree: TreeDFA
    rows: torch.Tensor  # int64 (n,): rows of the batch
    row_list: list[int] | None  # the same on the host, when known
    states: torch.Tensor  # int64 (n,)
    starts: torch.Tensor  # int64 (n,): where each row's allowed tokens start in allow_tok
    widths: torch.Tensor  # int64 (n,): allowed tokens per row (<= width)
    width: int

    @property
    def candidates(self) -> CandidateRows:
        """These rows as the backend's candidate kernels take them."""
        return CandidateRows(self.rows, self.starts, self.widths, self.tree.allow_tok, self.width)

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 (n, width): each row's allowed logits, -inf padding."""
        return self.tree.backend.gather_candidate_logits(logits, self.candidates)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 (n,): each row's greedy token over its allowed logits (the dense argmax of the
        masked row: ties to the smallest token id), with no layout written."""
        return self.tree.backend.candidate_argmax(logits, self.candidates)

    def sample(self, logits, temperature, greedy, top_k, top_p, uniform) -> torch.Tensor:
        """int64 (n,): each row's token drawn over its allowed logits (Backend.sample_candidates:
        per-row temperature, greedy flags, top-k, top-p and float64 uniforms, n entries each), with
        no layout written where the backend fuses it."""
        return self.tree.backend.sample_candidates(logits, self.candidates, temperature, greedy, top_k, top_p, uniform)

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """int64 token ids of columns (n, k) of this layout. Padding columns (only a row whose
        allowed logits are all -inf, or a top-n past a row's width, reaches them) map to the row's
        last allowed token."""
        columns = torch.minimum(columns.to(torch.int64), (self.widths - 1).unsqueeze(1))
        return self.tree.allow_tok[self.starts.unsqueeze(1) + columns].to(torch.int64)

    def all_token_ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids int64 (n, width), valid bool (n, width)): the map of every column."""
        offs = torch.arange(self.width, device=self.rows.device)
        valid = offs < self.widths.unsqueeze(1)
        return self.token_ids(offs.expand(len(self.rows), -1)), valid


@dataclass(frozen=True)
class DenseRows:
    """Rows of a batch sampled over the whole vocabulary (identity map), masked to the tree."""

    tree: TreeDFA
    rows: torch.Tensor  # int64 (n,)
    row_list: list[int] | None
    states: torch.Tensor  # int64 (n,)

    def mask(self, logits: torch.Tensor) -> None:
        """Mask these rows of `logits` (B, V) in place to their allowed sets (bitmask fill + apply)."""
        from ..bitmask import apply_token_bitmask_inplace

        bitmask = torch.empty((len(self.rows), num_bitmask_words(logits.shape[-1])), dtype=torch.int32, device=self.tree.device)
        self.tree.fill_bitmask(self.states, bitmask)
        full = self.row_list is not None and self.row_list == list(range(logits.shape[0]))
        if full:
            apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
            return
        # Rows of the bitmask are indexed by logits row: scatter the filled rows to their places.
        placed = torch.empty((logits.shape[0], bitmask.shape[1]), dtype=torch.int32, device=logits.device)
        placed.index_copy_(0, self.rows.to(logits.device), bitmask.to(logits.device))
        apply_token_bitmask_inplace(logits, placed, indices=self.rows.to(logits.device))


@dataclass(frozen=True)
class TreeStepPlan:
    """How one step lays out a batch: dense rows (or None) and sparse width groups."""

    batch_size: int
    vocab_size: int
    dense: DenseRows | None
    sparse: tuple[SparseRows, ...]

    @property
    def all_dense(self) -> bool:
        return not self.sparse

    @property
    def sparse_values(self) -> int:
        """Values the sparse layouts hold (their padded size)."""
        return sum(len(g.rows) * g.width for g in self.sparse)


def host_widths(tree: TreeDFA, host_states: np.ndarray) -> np.ndarray:
    """int64 allowed-token counts of host states (no device access)."""
    ptr = tree.host.allow_ptr  # (CompiledTree.widths is a diff over every node: not per step)
    return ptr[host_states + 1] - ptr[host_states]


def _as_host_states(tree: TreeDFA, host_states: Sequence[int] | np.ndarray) -> np.ndarray:
    states = np.asarray(host_states, dtype=np.int64).reshape(-1)
    if len(states) and (states.min() < 0 or states.max() >= tree.num_states):
        bad = int(states[(states < 0) | (states >= tree.num_states)][0])
        raise ValueError(f"state {bad} is not a state of this tree (0 <= state < {tree.num_states})")
    return states


def _check_rows(rows: Sequence[int] | np.ndarray | torch.Tensor, n: int) -> list[int]:
    """`rows` as a list of distinct non-negative ints, one per state; ValueError naming the entry.
    (A repeated row would leave another row of the output unwritten; the kernels index logits
    with these rows unchecked.)"""
    values = rows.tolist() if isinstance(rows, (np.ndarray, torch.Tensor)) else list(rows)
    if len(values) != n:
        raise ValueError(f"rows has {len(values)} entries for {n} states")
    seen: dict[int, int] = {}
    for i, row in enumerate(values):
        if not is_integer(row):
            raise ValueError(f"rows[{i}] = {short_repr(row)} is not an integer row index")
        if not 0 <= row <= _MAX_ROW:
            raise ValueError(f"rows[{i}] = {short_repr(row)} is outside [0, {_MAX_ROW}]")
        if row in seen:
            raise ValueError(f"rows[{i}] = {row} repeats rows[{seen[row]}]: each batch row belongs to one state")
        seen[row] = i
    return [int(r) for r in values]


def _split(widths: np.ndarray) -> list[np.ndarray]:
    """Row indices (into `widths`) of at most two width buckets, split where the padded size plus a
    per-group cost is smallest."""
    n = len(widths)
    if n * int(widths.max()) - int(widths.sum()) <= _GROUP_COST:
        # No split can save more padding than the batch holds: one group, no sort.
        return [np.arange(n)]
    order = np.argsort(widths, kind="stable")
    sorted_w = widths[order]
    k = np.arange(1, n)  # rows [0, k) narrow, [k, n) wide
    costs = k * sorted_w[:-1] + (n - k) * sorted_w[-1] + _GROUP_COST
    best_k = int(k[np.argmin(costs)]) if n > 1 and costs.min() < n * sorted_w[-1] else n
    if best_k == n:
        return [np.arange(n)]
    return [np.sort(order[:best_k]), np.sort(order[best_k:])]


@functools.lru_cache(maxsize=64)
def _identity_rows(n: int, device: torch.device) -> torch.Tensor:
    """int64 0..n-1 (read-only: rows are only ever indexed with), one per batch size and device."""
    return torch.arange(n, device=device)


def plan_tree_step(
    tree: TreeDFA,
    states: torch.Tensor,
    vocab_size: int,
    *,
    host_states: Sequence[int] | np.ndarray | None = None,
    sparse_max_fraction: float | None = None,
    rows: Sequence[int] | None = None,
    exact: bool | None = None,
) -> TreeStepPlan:
    """Plan the layouts of a batch whose row i is in tree state states[i] (int64 (n,) on the tree's
    device). `host_states` (the same values on the host) gives exact widths without reading the
    device; on a CPU tree they are read from `states`. `rows`: the batch rows the states belong to
    (default 0..n-1): distinct non-negative ints, else ValueError naming the entry; sampling the
    plan checks that they lie inside the logits' batch. `vocab_size`: the logits' width. `exact=False` forces the device-only plan
    (one group as wide as the tree's widest state: the same shapes every step)."""
    # Called every decode step: below ~1 ms a step its Python overhead is the cost, so it builds
    # index tensors from numpy (no Python lists of rows) and skips the split when it cannot pay.
    fraction = resolve_sparse_max_fraction(sparse_max_fraction)
    if tree.max_token_id >= vocab_size:
        raise ValueError(f"the tree uses token id {tree.max_token_id} but the logits have only {vocab_size} columns")
    states = tree.check_states(states).long()
    n = states.shape[0]
    if rows is None:
        row_list = list(range(n))
        row_array = None  # the identity
    else:
        row_list = _check_rows(rows, n)
        row_array = np.asarray(row_list, dtype=np.int64)
    batch = max(row_list) + 1 if row_list else 0
    device = states.device
    on_host = device.type == "cpu"
    upload = (lambda a: torch.from_numpy(a)) if on_host else (lambda a: to_device(torch.from_numpy(a), device))  # noqa: E731
    all_rows = _identity_rows(n, device) if row_array is None else upload(row_array)
    limit = fraction * vocab_size
    host = None
    if exact is False:
        host_states = None
    elif host_states is None and on_host:
        host = states.numpy()  # checked by check_states
    if host is None and host_states is None:
        # States stay on the device: the tree's widest state bounds every row.
        if n == 0 or tree.max_width > limit:
            return TreeStepPlan(batch, vocab_size, DenseRows(tree, all_rows, row_list, states) if n else None, ())
        group = SparseRows(
            tree, all_rows, row_list, states, tree.allow_start[states], tree.widths[states].long(), tree.max_width
        )
        return TreeStepPlan(batch, vocab_size, None, (group,))
    if host is None:
        host = _as_host_states(tree, host_states)
        if len(host) != n:
            raise ValueError(f"host_states has {len(host)} entries for {n} states")
    if n == 0:
        return TreeStepPlan(batch, vocab_size, None, ())
    starts = tree.host.allow_ptr[host]  # int64 copies
    widths = tree.host.allow_ptr[host + 1] - starts
    if tree.max_width <= limit and n * tree.max_width <= _GROUP_COST:
        # A narrow tree (catalogs): whatever the states, no row is dense and no split can pay.
        # One group as wide as the tree's widest state (a bounded padding), no reductions.
        group = SparseRows(tree, all_rows, row_list, states, upload(starts), upload(widths), tree.max_width)
        return TreeStepPlan(batch, vocab_size, None, (group,))

    def pick(index: np.ndarray) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        if len(index) == n:
            return all_rows, row_list, states
        picked = index if row_array is None else row_array[index]
        picked_states = upload(host[index]) if on_host else states[upload(index)]
        return upload(picked), picked.tolist(), picked_states

    if int(widths.max()) <= limit:  # the usual case: no dense row
        dense, sparse_idx = None, None
    else:
        dense_idx = np.flatnonzero(widths > limit)
        dense = DenseRows(tree, *pick(dense_idx))
        sparse_idx = np.flatnonzero(widths <= limit)
    groups = []
    if sparse_idx is None or len(sparse_idx):
        for part in _split(widths if sparse_idx is None else widths[sparse_idx]):
            index = part if sparse_idx is None else sparse_idx[part]
            if len(index) == n:
                group_starts, group_widths = starts, widths
            else:
                group_starts, group_widths = starts[index], widths[index]
            groups.append(SparseRows(
                tree, *pick(index), upload(group_starts), upload(group_widths), int(group_widths.max()),
            ))
    return TreeStepPlan(batch, vocab_size, dense, tuple(groups))


def ragged_candidates(tree: TreeDFA, states: torch.Tensor, total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids int64 (total,), offsets int64 (n + 1,)): the allowed tokens of every row,
    concatenated (row i owns token_ids[offsets[i] : offsets[i + 1]], sorted), at a cost of their
    number. `total` = sum of the rows' widths; None reads it from the device (free on CPU, a host
    sync elsewhere: pass it when the caller knows it, e.g. from host-side states)."""
    states = tree.check_states(states).long()
    widths = tree.widths[states].long()
    offsets = torch.zeros(states.shape[0] + 1, dtype=torch.int64, device=states.device)
    torch.cumsum(widths, 0, out=offsets[1:])
    if total is None:
        total = int(offsets[-1])
    row_of = torch.repeat_interleave(torch.arange(states.shape[0], device=states.device), widths, output_size=total)
    position = torch.arange(total, device=states.device) - offsets[row_of]
    return tree.allow_tok[tree.allow_start[states][row_of] + position].long(), offsets


def keep_only_allowed(
    tree: TreeDFA, logits: torch.Tensor, states: torch.Tensor, rows: torch.Tensor | None = None, *, max_width: int | None = None
) -> torch.Tensor:
    """In place: row rows[i] of `logits` (B, V) (default row i) keeps only the tokens tree state
    states[i] allows, every other column -inf, columns past the tree's vocabulary included. This is
    how a logits processor, which must return whole rows, masks with the tree: fill the row and put
    the allowed logits back, with no bitmask built (its speed against fill_bitmask + apply:
    docs/trees.md, "Tree decode steps that cost what the tree allows"). `max_width` bounds the rows' widths (default the tree's
    widest state); rows must be distinct; no host sync. Returns logits."""
    states = tree.check_states(states).long()
    tree.check_device(logits, "logits")
    if tree.max_token_id >= logits.shape[-1]:
        raise ValueError(f"the tree uses token id {tree.max_token_id} but the logits have only {logits.shape[-1]} columns")
    if rows is None:
        if states.shape[0] != logits.shape[0]:
            raise ValueError(f"{states.shape[0]} states for {logits.shape[0]} logits rows; pass rows=")
        rows = torch.arange(states.shape[0], device=states.device)
    elif not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.shape != states.shape or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be a 1-D int32/int64 tensor with one entry per state ({states.shape[0]})")
    elif rows.device.type == "cpu" and len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]):
        # Free on the host (the kernel indexes logits unchecked); on a device it would be a sync.
        bad = int(rows[(rows < 0) | (rows >= logits.shape[0])][0])
        raise ValueError(f"rows holds {bad}, outside the {logits.shape[0]} rows of logits")
    tree.backend.keep_candidate_logits(logits, CandidateRows(
        rows, tree.allow_start[states], tree.widths[states].long(), tree.allow_tok,
        tree.max_width if max_width is None else max_width,
    ))
    return logits
