"""The one torch reference for every kernel logitgate ships.

Each backend's kernel is tested against the functions here on random inputs. They favour clarity
over speed and run on any device torch supports.
"""
from __future__ import annotations

import torch

BITS_PER_WORD = 32


def num_bitmask_words(vocab_size: int) -> int:
    """Words per bitmask row: ceil(vocab_size / 32)."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 (..., W) bitmask -> bool (..., vocab_size); True where the token is allowed."""
    shifts = torch.arange(BITS_PER_WORD, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool (..., V) -> int32 (..., ceil(V/32)); the inverse of unpack_bitmask."""
    vocab_size = allowed.shape[-1]
    words = num_bitmask_words(vocab_size)
    padded = torch.zeros(*allowed.shape[:-1], words * BITS_PER_WORD, dtype=torch.int64, device=allowed.device)
    padded[..., :vocab_size] = allowed.to(torch.int64)
    weights = torch.ones(BITS_PER_WORD, dtype=torch.int64, device=allowed.device) << torch.arange(
        BITS_PER_WORD, device=allowed.device
    )
    packed = (padded.view(*allowed.shape[:-1], words, BITS_PER_WORD) * weights).sum(-1)
    # Values >= 2**31 wrap to the negative int32 with the same bits (bit 31 set).
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def apply_token_bitmask_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None, vocab_size: int
) -> None:
    """Set logits[r, t] = -inf for every selected row r and token t < vocab_size whose bit is 0.

    logits (N, V') and bitmask (M, W) are 2-D; `rows` selects rows of both (xgrammar's `indices`),
    None means every row (then N == M).
    """
    selected_logits = logits if rows is None else logits[rows]
    selected_mask = bitmask if rows is None else bitmask[rows]
    allowed = unpack_bitmask(selected_mask, vocab_size)
    masked = selected_logits[:, :vocab_size].masked_fill(~allowed, float("-inf"))
    if rows is None:
        logits[:, :vocab_size] = masked
    else:
        logits[rows, :vocab_size] = masked


# ---- sampling ----------------------------------------------------------------------------------
#
# Top-k / top-p semantics (shared by every backend):
# - top-k keeps every token whose logit is >= the k-th largest logit of its row (ties at the k-th
#   value are all kept, as in vLLM); k <= 0 or k >= V leaves the row alone.
# - top-p keeps every token whose probability mass strictly above it, sum(p_j for p_j > p_i), is
#   < top_p, where p = softmax of the (top-k filtered) logits; the most likely token is always kept,
#   tied tokens are kept or removed together, and top_p >= 1 leaves the row alone.


def top_k_disabled(k: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Rows whose top-k value does not filter: k <= 0 or k >= V."""
    return (k <= 0) | (k >= vocab_size)


def apply_top_k_top_p_reference(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Sort-based top-k then top-p, in place on 2-D float logits (rows filtered by -inf); returns logits.

    k: int (B,) or None; p: float (B,) or None. Top-p sees the softmax of the top-k filtered row.
    """
    if k is None and p is None:
        return logits
    vocab_size = logits.shape[-1]
    if k is not None:
        sorted_logits = logits.sort(dim=-1, descending=True).values
        k_index = k.to(torch.int64).clamp(1, vocab_size).sub(1).unsqueeze(1)
        kth = sorted_logits.gather(1, k_index)
        kth.masked_fill_(top_k_disabled(k, vocab_size).unsqueeze(1), float("-inf"))
        logits.masked_fill_(logits < kth, float("-inf"))
    if p is not None:
        probs = logits.softmax(dim=-1)
        threshold = top_p_threshold(probs.sort(dim=-1, descending=True).values, p)
        logits.masked_fill_(probs < threshold, float("-inf"))
    return logits


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
    # keep is a prefix of the sorted row and holds at least the top token (mass above it is 0).
    threshold = sorted_probs.gather(1, keep.sum(dim=-1, keepdim=True) - 1)
    return threshold.masked_fill_((p >= 1).unsqueeze(1), 0.0)


def exponential_race(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The exponential trick: argmax(p / q) per row, q ~ Exp(1) i.i.d., is an exact draw from p
    (it is the first arrival of independent Poisson processes with rates p). int64 (B,)."""
    return probs.div(q).argmax(dim=-1)


def inverse_cdf_sample_reference(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: the first token whose cumulative probability exceeds u * total, with one
    uniform u in [0, 1) per row (float64); zero-probability tokens are never chosen. int64 (B,)."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = (u.to(torch.float64) * cdf[:, -1]).unsqueeze(1)
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return index.clamp_(max=probs.shape[-1] - 1)


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


def random_sample_reference(probs: torch.Tensor, generators: dict[int, torch.Generator] | None = None) -> torch.Tensor:
    """An exact draw per row (the exponential trick with noise drawn now). int64 (B,)."""
    q = fill_exponential(torch.empty(probs.shape, dtype=torch.float32, device=probs.device), generators)
    return exponential_race(probs, q)
