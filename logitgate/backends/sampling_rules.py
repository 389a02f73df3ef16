"""The sampling rules every backend obeys, as small torch helpers that production code and the
torch references share: temperature, rows without a distribution and their fallback token, the
top-k / top-p cut, and the random draws (exponential race, per-row generators).
"""
from __future__ import annotations

import torch

# ---- sampling ----------------------------------------------------------------------------------
#
# Top-k / top-p semantics (shared by every backend):
# - top-k keeps every token whose logit is >= the k-th largest logit of its row (ties at the k-th
#   value are all kept, as in vLLM); k <= 0 or k >= V leaves the row alone.
# - top-p keeps every token whose probability mass strictly above it, sum(p_j for p_j > p_i), is
#   < top_p, where p = softmax of the (top-k filtered) logits; the most likely token is always kept,
#   tied tokens are kept or removed together, and top_p >= 1 (or NaN) leaves the row alone. The
#   public functions reject top_p <= 0 where they can see it without a host sync; a device tensor
#   that slips through behaves as the smallest positive top_p (only the most likely tokens stay).
#
# Rows without a distribution (shared by every backend): a random row whose logits hold a NaN or a
# +inf, or no value above -inf, has no defined softmax. Such a row is sampled as a point mass on its
# fallback token: the argmax of the row with NaN ignored (a +inf wins; first of ties), token 0 when
# every value is NaN or -inf. The same holds for a probability row whose total is not a finite
# positive number, and for rejection sampling's target rows (a draft is accepted exactly when it is
# the fallback token, which is also the recovered token). Greedy rows keep torch.argmax (vLLM's: a
# NaN counts as the maximum).


def tempered_logits(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """float32 logits / temperature (per row); vLLM divides in float32 too."""
    logits = logits.float()
    return logits if temperature is None else logits / temperature.to(torch.float32).unsqueeze(-1)


def undefined_logit_rows(logits: torch.Tensor, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """bool (B,): rows of logits / temperature with no defined softmax (a NaN, a +inf, or nothing
    above -inf); one reduction, no host sync. The peak divided by the temperature is the peak of the
    tempered row (division by a positive number is monotonic), so no tempered copy is needed."""
    peak = logits.amax(dim=-1).to(torch.float32)
    if temperature is not None:
        peak = peak / temperature.to(torch.float32)
    return ~torch.isfinite(peak)


def undefined_prob_rows(probs: torch.Tensor) -> torch.Tensor:
    """bool (B,): probability rows whose total is not a finite positive number (a NaN, an inf, all 0)."""
    total = probs.sum(dim=-1, dtype=torch.float32)
    return ~(torch.isfinite(total) & (total > 0))


def fallback_tokens(scores: torch.Tensor) -> torch.Tensor:
    """int64 (B,): each row's argmax with NaN ignored (first of ties), 0 for a row of NaN / -inf."""
    return scores.masked_fill(torch.isnan(scores), float("-inf")).argmax(dim=-1)


def top_k_disabled(k: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Rows whose top-k value does not filter: k <= 0 or k >= V."""
    return (k <= 0) | (k >= vocab_size)


def top_p_threshold(sorted_probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """(B, 1): the smallest probability top-p keeps, from each row's probabilities sorted in
    descending order (a row may hold only its largest probabilities, as long as every probability
    above the cut is there); 0 for rows with p >= 1."""
    # Mass strictly above each sorted position, accumulated in float64 so that the cut does not
    # depend on float32 rounding of long cumulative sums.
    sorted64 = sorted_probs.to(torch.float64)
    mass_above = sorted64.cumsum(dim=-1) - sorted64
    # Tied probabilities share the mass above the first of them.
    first_of_tie = torch.ones_like(sorted_probs, dtype=torch.bool)
    first_of_tie[:, 1:] = sorted_probs[:, 1:] != sorted_probs[:, :-1]
    positions = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)
    group_start = torch.where(first_of_tie, positions, 0).cummax(dim=-1).values
    keep = mass_above.gather(1, group_start) < p.to(torch.float64).unsqueeze(1)
    # keep is a prefix of the sorted row; the top token (mass above it is 0) stays even when
    # p <= 0 or the row is NaN (then nothing compares below p).
    threshold = sorted_probs.gather(1, keep.sum(dim=-1, keepdim=True).clamp_(min=1) - 1)
    return threshold.masked_fill_(((p >= 1) | torch.isnan(p)).unsqueeze(1), 0.0)


def exponential_race(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The exponential trick: argmax(p / q) per row, q ~ Exp(1) i.i.d., is an exact draw from p
    (it is the first arrival of independent Poisson processes with rates p). int64 (B,)."""
    return probs.div(q).argmax(dim=-1)


def fill_exponential(q: torch.Tensor, generators: dict[int, torch.Generator] | None) -> torch.Tensor:
    """q ~ Exp(1) in place; rows listed in `generators` draw from their own generator (reproducible),
    the others from the device's default generator. Values are clamped away from 0 so p / q is never
    0 / 0 (a NaN that argmax would pick)."""
    generators = generators or {}
    if len(generators) != q.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return q.clamp_(min=torch.finfo(q.dtype).tiny)


def draw_uniforms(batch_size: int, generators: dict[int, torch.Generator] | None, device: torch.device) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row; rows in `generators` draw from their own generator."""
    generators = generators or {}
    u = torch.rand(batch_size, dtype=torch.float64, device=device) if len(generators) != batch_size else (
        torch.empty(batch_size, dtype=torch.float64, device=device)
    )
    for row, generator in generators.items():
        u[row : row + 1].uniform_(generator=generator)
    return u



# Seeds of kernels that generate their noise from one seed per row (backends/triton/philox.py).
PHILOX_SEED_HIGH = 2**62


def draw_seeds(
    batch_size: int, generators: dict[int, torch.Generator] | None, device: torch.device, high: int = PHILOX_SEED_HIGH
) -> torch.Tensor:
    """int64 (B,) seeds in [0, high), one per row, for kernels that generate their noise from a
    seed; rows in `generators` draw theirs from their own generator (one draw per call)."""
    generators = generators or {}
    seeds = torch.empty(batch_size, dtype=torch.int64, device=device)
    if len(generators) != batch_size:
        seeds.random_(0, high)
    for row, generator in generators.items():
        seeds[row : row + 1].random_(0, high, generator=generator)
    return seeds
