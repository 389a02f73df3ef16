"""One decode step of a batch constrained by one TreeDFA, sampled and verified over the tree's
candidates instead of the vocabulary (the sparse layout of structured/tree/candidates.py).

Every target row (each sequence's draft positions, then its bonus position, vLLM's layout) is
gathered to its state's allowed logits, plus one always -inf "reject" column. Drafts become
columns: an allowed draft its column, a draft the tree does not allow the reject column (target
probability 0 there, as in the masked dense row, and draft probability 0, so the residual of the
rejected row is the dense one restricted to the allowed tokens, which is all of it), a placeholder
id (outside the vocabulary) a placeholder column. Draft probabilities are gathered to the same
columns. The rejection sampler then runs unchanged on the (rows, width) layout, and emitted columns
map back to token ids. Same distribution as masking the full rows and verifying them; greedy
output identical (columns follow token order, so the argmax breaks ties as the dense one).
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np
import torch

from ..backends.transfer import to_device
from ..sampling.rejection import rejection_sample
from ..sampling.sampler import Sampler, SamplingMetadata
from ..sampling.tree_sampling import sample_plan
from ..structured.tree import TreeDFA
from ..structured.tree.candidates import SparseRows, host_widths, plan_tree_step, resolve_sparse_max_fraction

__all__ = ["tree_spec_step", "use_sparse_verification"]


_allow_codes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _draft_columns(tree: TreeDFA, states: np.ndarray, tokens: Sequence[int], vocab: int, width: int) -> np.ndarray:
    """Column of each draft in its state's candidates; width - 1 (the reject column) when the state
    does not allow it; width (a placeholder) for ids outside the vocabulary. One searchsorted over
    the tree's (state, token) codes, which are sorted as the CSR rows are."""
    codes = _allow_codes.get(tree)
    if codes is None:
        host = tree.host
        owner = np.repeat(np.arange(len(host.allow_ptr) - 1, dtype=np.int64), np.diff(host.allow_ptr))
        codes = _allow_codes.setdefault(tree, (owner << 32) | host.allow_tok.astype(np.int64))
    t = np.asarray(tokens, dtype=np.int64)
    query = (states << 32) | np.clip(t, 0, (1 << 32) - 1)
    at = np.minimum(np.searchsorted(codes, query), len(codes) - 1)
    columns = np.where(codes[at] == query, at - tree.host.allow_ptr[states], width - 1)
    return np.where((t >= 0) & (t < vocab), columns, width).astype(np.int64)


def use_sparse_verification(tree: TreeDFA, host_states: Sequence[int], vocab_size: int, sparse_max_fraction: float | None = None) -> bool:
    """Whether the step's rows (all in one layout of width max(widths) + 1) are cheaper sparse:
    the widest row, plus the reject column, within the crossover fraction of the vocabulary."""
    widest = int(host_widths(tree, np.asarray(host_states, dtype=np.int64)).max()) if len(host_states) else 0
    return widest + 1 <= resolve_sparse_max_fraction(sparse_max_fraction) * vocab_size


def tree_spec_step(
    sampler: Sampler,
    logits: torch.Tensor,
    tree: TreeDFA,
    host_states: Sequence[int],
    drafts: Sequence[Sequence[int]],
    metadata: SamplingMetadata,
    *,
    draft_probs: torch.Tensor | None = None,
    sparse_max_fraction: float | None = None,
) -> list[list[int]]:
    """The tokens each sequence emits this step: accepted drafts, then the correction or the bonus
    token. `logits` (N + B, V) in vLLM's layout, `host_states` the tree state of each of those rows
    (a sequence's state before each draft, then after its drafts), `drafts` each sequence's draft
    tokens, `draft_probs` (N, V) or None (point-mass drafts), `metadata` one row per sequence.
    Without drafts the bonus rows are planned like any step (dense rows past the crossover, width
    buckets); with drafts every row shares one sparse layout."""
    tree.check_device(logits, "logits")  # the tree's kernels read the logits rows
    counts = [len(d) for d in drafts]
    batch, vocab = len(drafts), logits.shape[-1]
    device = logits.device
    if sum(counts) == 0:
        states = to_device(torch.tensor(list(host_states), dtype=torch.int64), tree.device)
        plan = plan_tree_step(tree, states, vocab, host_states=host_states, sparse_max_fraction=sparse_max_fraction)
        out = sample_plan(sampler, plan, logits, metadata)
        return [[t] for t in out.sampled_token_ids[:, 0].tolist()]
    host = np.asarray(host_states, dtype=np.int64)
    ptr = tree.host.allow_ptr
    widths = host_widths(tree, host)
    width = int(widths.max()) + 1  # the last column is never allowed: drafts the tree rejects point there
    upload = lambda a: to_device(torch.from_numpy(np.ascontiguousarray(a)), device)  # noqa: E731
    group = SparseRows(
        tree, upload(np.arange(len(host))), None, upload(host), upload(ptr[host].astype(np.int64)),
        upload(widths), width,
    )
    gathered = group.gather(logits)
    # Row of each draft and of each bonus position in the (N + B) layout.
    offsets = np.concatenate([[0], np.cumsum([c + 1 for c in counts])])
    draft_rows = np.concatenate([np.arange(offsets[i], offsets[i] + counts[i]) for i in range(batch)]).astype(np.int64)
    bonus_rows = offsets[1:] - 1
    draft_columns = torch.from_numpy(_draft_columns(tree, host[draft_rows], [t for d in drafts for t in d], vocab, width)).to(device)
    draft_index, bonus_index = upload(draft_rows), upload(bonus_rows)
    gathered_probs = None
    if draft_probs is not None:
        ids, valid = group.all_token_ids()
        ids, valid = ids.index_select(0, draft_index), valid.index_select(0, draft_index)
        gathered_probs = torch.where(valid, draft_probs.gather(1, ids), 0.0)
    bonus = sampler(gathered.index_select(0, bonus_index), metadata).sampled_token_ids.squeeze(1)
    out = rejection_sample(
        draft_columns, counts, gathered.index_select(0, draft_index), bonus, draft_probs=gathered_probs,
        temperature=metadata.temperature, top_k=metadata.top_k, top_p=metadata.top_p, generators=metadata.generators,
    )
    # Output position j of sequence r was drawn from layout row offsets[r] + j.
    positions = torch.arange(out.shape[1], device=device)
    layout_rows = (upload(offsets[:-1]).unsqueeze(1) + positions).clamp(max=len(host) - 1)
    starts, row_widths = group.starts[layout_rows], group.widths[layout_rows]
    tokens = tree.allow_tok[starts + torch.minimum(out.clamp(min=0).long(), row_widths - 1)].long()
    tokens = torch.where(out >= 0, tokens, -1)
    return [[t for t in row if t >= 0] for row in tokens.tolist()]
