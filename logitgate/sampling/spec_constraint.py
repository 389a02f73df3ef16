"""Constraint-aware speculative decoding: grammar / tree masks at every draft position.

RTP-LLM refuses tree decode under speculative decoding; vLLM masks the target at each draft
position. This layer does the same from bitmask rows alone (one per draft position plus one for the
bonus position, e.g. `StructuredOutputManager.grammar_bitmask(..., spec_tokens)` or a TreeDFA
advanced through the drafts), so it works with any constraint:

- the target logits of every position are masked, so the verified distribution is the
  constrained target's (rejection sampling is exact for any target);
- a draft the constraint rejects has target probability 0 there, so it is always rejected and the
  token emitted in its place is drawn from the constrained residual (greedy: the constrained
  argmax); the rows after it (which a grammar fills with its last valid state) are never reached;
- `num_valid_drafts` tells the caller how many leading drafts the constraint allows, i.e. the most
  that can be accepted — with no re-layout and no host sync.

Forced tokens (a position whose mask allows one token, e.g. TreeDFA.forced_tokens) can be appended
as drafts: the constrained target gives them probability 1, so they are always accepted (give them
a one-hot draft_probs row, or verify without draft probs).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..backends import Backend
from ..backends.formats import BITS_PER_WORD, leading_true_counts
from ..structured.bitmask import apply_token_bitmask_inplace
from .rejection import check_num_draft_tokens, host_spec_layout

logger = logging.getLogger(__name__)

__all__ = ["ConstrainedSpecLogits", "constrain_spec_logits", "valid_draft_counts"]


@dataclass(frozen=True)
class ConstrainedSpecLogits:
    target_logits: torch.Tensor  # (N, V): masked logits of the draft positions, for rejection_sample
    bonus_logits: torch.Tensor  # (B, V): masked logits of the bonus positions, to sample the bonus token
    num_valid_drafts: torch.Tensor  # int32 (B,): leading drafts the constraint allows


def valid_draft_counts(
    draft_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor, draft_bitmask: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """int32 (B,): per request, how many leading drafts have their bit set in their position's row
    of `draft_bitmask` (N, W). Ids outside [0, vocab_size) (placeholders) are invalid; ids the
    bitmask does not cover (>= 32 W) are left unmasked by the bitmask apply, hence valid."""
    ids = draft_token_ids.to(torch.int64)
    covered = draft_bitmask.shape[-1] * BITS_PER_WORD
    in_vocab = (ids >= 0) & (ids < vocab_size)
    safe = torch.where(in_vocab & (ids < covered), ids, 0)
    words = draft_bitmask.gather(-1, (safe // BITS_PER_WORD).unsqueeze(-1)).squeeze(-1)
    bit = ((words >> (safe % BITS_PER_WORD).to(torch.int32)) & 1).bool()
    valid = in_vocab & (bit | (ids >= covered))
    return leading_true_counts(valid, cu_num_draft_tokens)


def constrain_spec_logits(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int] | torch.Tensor,
    *,
    rows: Sequence[int] | None = None,
    backend: str | torch.device | Backend | None = None,
) -> ConstrainedSpecLogits:
    """Mask every draft and bonus position and split the rows for verification.

    logits: float (N + B, V) in vLLM's layout — each request's N_r draft-position rows, then its
    bonus row — masked IN PLACE. bitmask: int32 (N + B, ceil(V/32)), the same rows (xgrammar's
    format). draft_token_ids: int (N,), num_draft_tokens: B ints. rows: the rows that carry a
    constraint, when the others are all-allowed (-1): only those are masked (None = every row).
    """
    counts = check_num_draft_tokens(num_draft_tokens)
    num_tokens, batch = sum(counts), len(counts)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != num_tokens + batch:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be 2-D with {num_tokens + batch} rows (drafts + one bonus per request), got {shape}")
    if not isinstance(bitmask, torch.Tensor) or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        shape = tuple(bitmask.shape) if isinstance(bitmask, torch.Tensor) else type(bitmask).__name__
        raise ValueError(f"bitmask must be 2-D with one row per logits row ({logits.shape[0]}), got {shape}")
    if not isinstance(draft_token_ids, torch.Tensor) or draft_token_ids.dim() != 1 or draft_token_ids.numel() != num_tokens:
        raise ValueError(f"draft_token_ids must be a 1-D tensor of the {num_tokens} draft tokens")
    if draft_token_ids.device != logits.device:
        raise ValueError(f"draft_token_ids are on {draft_token_ids.device} but logits on {logits.device}")
    vocab = logits.shape[-1]
    apply_token_bitmask_inplace(
        logits, bitmask, indices=rows, vocab_size=min(vocab, bitmask.shape[-1] * BITS_PER_WORD), backend=backend
    )
    cu, _, _, token_request = host_spec_layout(counts, logits.device)
    # Row of draft t of request r in the (N + B) layout: t + r (r bonus rows precede it); bonus row: cu[r] + r.
    draft_rows = torch.arange(num_tokens, device=logits.device) + token_request
    bonus_rows = cu.to(torch.int64) + torch.arange(batch, device=logits.device)
    num_valid = valid_draft_counts(draft_token_ids, cu, bitmask.index_select(0, draft_rows), vocab)
    return ConstrainedSpecLogits(logits.index_select(0, draft_rows), logits.index_select(0, bonus_rows), num_valid)
