"""The torch references of speculative decoding's rejection sampling (accept, recovery weights,
recovered-token draws) on vLLM's flattened draft layout.
"""
from __future__ import annotations

import torch

from ..formats import leading_true_counts, rejection_output, spec_layout
from ..sampling_rules import fallback_tokens, tempered_logits

# Layout: backends/formats.py (spec_layout). Every kernel below returns defined values (0) for
# inactive requests and for requests that accepted all their drafts, so backends can be compared
# exactly.


def _rows_at(cu_num_draft_tokens: torch.Tensor, accepted: torch.Tensor, num_tokens: int):
    """Row of each request's first rejected draft (clamped into range) and whether there is one."""
    starts, counts, _ = spec_layout(cu_num_draft_tokens, num_tokens)
    rejected = accepted.to(torch.int64) < counts
    rows = (starts + accepted.to(torch.int64)).clamp(0, max(num_tokens - 1, 0))
    return rows, rejected


def _at_first_rejection(cu_num_draft_tokens, accepted, per_row, active, num_tokens):
    """(accepted, per_row at each request's first rejected row) with 0 for requests that accepted
    everything or are inactive."""
    rows, rejected = _rows_at(cu_num_draft_tokens, accepted, num_tokens)
    keep = rejected if active is None else rejected & active
    zero = torch.zeros((), dtype=per_row.dtype, device=per_row.device)
    value = torch.where(keep, per_row[rows], zero) if num_tokens else zero.expand(accepted.shape)
    if active is not None:
        accepted = torch.where(active, accepted, 0)
    return accepted.to(torch.int32), value


def rejection_greedy_accept_reference(
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    active: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: (accepted int32 (B,), correction int32 (B,)).

    accepted = leading drafts equal to the target argmax (torch.argmax semantics: first maximum,
    a NaN counts as the maximum); correction = the argmax at the first mismatch, 0 when every draft
    matched or the request is inactive (active False)."""
    argmax = target_logits.float().argmax(-1)
    accepted = leading_true_counts(draft_token_ids.to(torch.int64) == argmax, cu_num_draft_tokens)
    accepted, correction = _at_first_rejection(cu_num_draft_tokens, accepted, argmax, active, argmax.numel())
    return accepted, correction.to(torch.int32)


def rejection_random_accept_reference(
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    draft_probs: torch.Tensor | None,
    uniform: torch.Tensor,
    active: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random verification: (accepted int32 (B,), row_lse float32 (B,)).

    Draft x at row i is accepted while x is in [0, V), draft_p > 0, target_p > 0 and
    target_p / draft_p >= uniform[i], where target_p = softmax(logits_i / T_i)[x] and draft_p =
    draft_probs[i, x] (1 without draft probs: an n-gram draft is a point mass). A row without a
    distribution (its logsumexp is not finite: a NaN, a +inf, all -inf) is a point mass on its
    fallback token (target_p 1 there, 0 elsewhere). row_lse is the logsumexp of the tempered logits
    at the first rejected row (0 when none / inactive), which `rejection_recover` needs to
    normalise that row without another pass."""
    num_tokens, vocab = target_logits.shape
    z = tempered_logits(target_logits, temperature)
    lse = z.logsumexp(-1)
    ids = draft_token_ids.to(torch.int64)
    valid = (ids >= 0) & (ids < vocab)
    safe = ids.clamp(0, vocab - 1).unsqueeze(-1)
    target_p = (z.gather(-1, safe).squeeze(-1) - lse).exp().double()
    target_p = torch.where(torch.isfinite(lse), target_p, (ids == fallback_tokens(z)).double())
    draft_p = torch.ones_like(target_p) if draft_probs is None else draft_probs.gather(-1, safe).squeeze(-1).double()
    ok = valid & (draft_p > 0) & (target_p > 0) & (target_p / draft_p >= uniform)
    accepted = leading_true_counts(ok, cu_num_draft_tokens)
    accepted, row_lse = _at_first_rejection(cu_num_draft_tokens, accepted, lse, active, num_tokens)
    return accepted, row_lse.to(torch.float32)


def recovery_weights_reference(
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    draft_probs: torch.Tensor | None,
    accepted: torch.Tensor,
    row_lse: torch.Tensor,
    active: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(needed bool (B,), weights float32 (B, V)): the unnormalised distribution of the recovered
    token at each request's first rejected row.

    weights = max(target - draft, 0) with draft probs; the target without the draft token for an
    n-gram draft; the target itself for a placeholder (there was no draft to correct). NaN counts as
    0. When nothing is left (target == draft) the target is used. A row without a distribution
    (row_lse not finite) weighs only its fallback token."""
    num_tokens, vocab = target_logits.shape
    rows, needed = _rows_at(cu_num_draft_tokens, accepted, num_tokens)
    if active is not None:
        needed = needed & active
    if num_tokens == 0:
        return needed, torch.zeros(needed.numel(), vocab, device=target_logits.device)
    z = tempered_logits(target_logits[rows], None if temperature is None else temperature[rows])
    target = (z - row_lse.unsqueeze(-1)).exp()
    target = torch.where(target > 0, target, 0.0)
    ids = draft_token_ids.to(torch.int64)[rows]
    valid = ((ids >= 0) & (ids < vocab)).unsqueeze(-1)
    if draft_probs is None:
        drafted = torch.arange(vocab, device=target.device) == ids.unsqueeze(-1)
        residual = target.masked_fill(drafted, 0.0)
    else:
        residual = target - draft_probs[rows].float()
    residual = torch.where(valid & (residual > 0), residual, torch.where(valid, 0.0, target))
    empty = ~(residual.sum(-1, keepdim=True) > 0)
    weights = torch.where(empty, target, residual)
    point = torch.arange(vocab, device=z.device) == fallback_tokens(z).unsqueeze(-1)
    return needed, torch.where(torch.isfinite(row_lse).unsqueeze(-1), weights, point.to(weights.dtype))


def rejection_recover_inverse_cdf_reference(needed: torch.Tensor, weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw, one float64 uniform per request: the first token whose cumulative weight
    (float64) exceeds uniform * total; int32 (B,), 0 where not needed or all weights are 0."""
    if weights.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int32, device=weights.device)
    cum = weights.double().cumsum(-1)
    total = cum[:, -1]
    token = torch.searchsorted(cum, (uniform * total).unsqueeze(-1), right=True).squeeze(-1)
    vocab = weights.shape[-1]
    last_positive = vocab - 1 - (weights > 0).flip(-1).to(torch.int8).argmax(-1)
    token = torch.where(token >= vocab, last_positive, token)  # uniform * total rounded up to total
    return torch.where(needed & (total > 0), token, 0).to(torch.int32)


def rejection_recover_exponential_reference(needed: torch.Tensor, weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race argmax(w / q), q ~ Exp(1) per (request, token), float32 like vLLM;
    zero-weight tokens never win. int32 (B,), 0 where not needed or all weights are 0."""
    if weights.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int32, device=weights.device)
    score = torch.where(weights > 0, weights / noise, -1.0)
    return torch.where(needed, score.argmax(-1), 0).to(torch.int32)



def rejection_verify_reference(
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    draft_probs: torch.Tensor | None,
    uniform: torch.Tensor | None,
    q: torch.Tensor | None,
    bonus: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """`Backend.rejection_verify`'s output (B, width) with given recovery noise: greedy requests
    (temperature None: all; else those at temperature 0) accept while the draft is the argmax, the
    others are verified with `uniform` at their temperature and recover with the race over q
    (B, V), or by inverse CDF for float64 uniforms q (B,) (the CPU's noise); then the accepted
    drafts, the correction (or the bonus), -1."""
    starts, counts, token_request = spec_layout(cu_num_draft_tokens, draft_token_ids.numel())
    if temperature is None:
        accepted, correction = rejection_greedy_accept_reference(cu_num_draft_tokens, draft_token_ids, target_logits, None)
    else:
        greedy = temperature == 0
        token_t = temperature.to(torch.float32)[token_request]
        token_t = torch.where(token_t == 0, 1.0, token_t)
        g_acc, g_corr = rejection_greedy_accept_reference(cu_num_draft_tokens, draft_token_ids, target_logits, greedy)
        r_acc, lse = rejection_random_accept_reference(
            cu_num_draft_tokens, draft_token_ids, target_logits, token_t, draft_probs, uniform, ~greedy
        )
        needed, weights = recovery_weights_reference(
            cu_num_draft_tokens, draft_token_ids, target_logits, token_t, draft_probs, r_acc, lse, ~greedy
        )
        recover = rejection_recover_inverse_cdf_reference if q.dim() == 1 else rejection_recover_exponential_reference
        r_corr = recover(needed, weights, q)
        accepted, correction = torch.where(greedy, g_acc, r_acc), torch.where(greedy, g_corr, r_corr)
    final = torch.where(accepted.to(torch.int64) < counts, correction.to(torch.int64), bonus.to(torch.int64))
    return rejection_output(starts, draft_token_ids, accepted, final, width)
