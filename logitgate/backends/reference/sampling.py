"""The torch references of sampling: the sort-based top-k / top-p filter and the exact draws
(inverse CDF with given uniforms, the exponential race with noise drawn now). Rules:
backends/sampling_rules.py.
"""
from __future__ import annotations

import torch

from ..sampling_rules import (
    exponential_race,
    fallback_tokens,
    fill_exponential,
    tempered_logits,
    top_k_disabled,
    top_p_threshold,
    undefined_logit_rows,
    undefined_prob_rows,
)


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


def inverse_cdf_sample_reference(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: the first token whose cumulative probability exceeds u * total, with one
    uniform u in [0, 1) per row (float64); zero-probability tokens are never chosen; a row whose
    total is not a finite positive number gives its fallback token. int64 (B,)."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1]
    target = (u.to(torch.float64) * total).unsqueeze(1)
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    index = index.clamp_(max=probs.shape[-1] - 1)
    undefined = ~(torch.isfinite(total) & (total > 0))
    return torch.where(undefined, fallback_tokens(probs), index)


def random_sample_reference(probs: torch.Tensor, generators: dict[int, torch.Generator] | None = None) -> torch.Tensor:
    """An exact draw per row (the exponential trick with noise drawn now); a row without a
    distribution gives its fallback token. int64 (B,)."""
    q = fill_exponential(torch.empty(probs.shape, dtype=torch.float32, device=probs.device), generators)
    return torch.where(undefined_prob_rows(probs), fallback_tokens(probs), exponential_race(probs, q))



def race_sample_reference(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`random_sample` with given race noise q (B, V): argmax(probs / q), a row without a total
    given its fallback token. int64 (B,)."""
    return torch.where(undefined_prob_rows(probs), fallback_tokens(probs), exponential_race(probs, q))


def sample_from_logits_reference(
    logits: torch.Tensor, temperature: torch.Tensor | None, k: torch.Tensor | None, p: torch.Tensor | None, q: torch.Tensor
) -> torch.Tensor:
    """`Backend.sample_from_logits` with given noise: logits / temperature (per row, None: as they
    are), top-k, top-p, softmax, then argmax(probs / q) for race noise q (B, V), or the inverse-CDF
    draw for float64 uniforms q (B,) (the CPU's noise); a row of the tempered logits without a
    distribution gives its fallback token. int64 (B,)."""
    z = tempered_logits(logits, temperature)
    probs = apply_top_k_top_p_reference(z.clone(), k, p).softmax(dim=-1)
    drawn = inverse_cdf_sample_reference(probs, q) if q.dim() == 1 else exponential_race(probs, q)
    return torch.where(undefined_logit_rows(z), fallback_tokens(z), drawn)
