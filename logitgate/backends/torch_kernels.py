"""Kernels written as torch operations that run on any device, used by backends without a custom
kernel for an operation. Results equal the reference (backends/reference/) exactly."""
from __future__ import annotations

import torch

from .reference import apply_top_k_top_p_reference
from .sampling_rules import top_p_threshold


def apply_top_k_top_p_torch(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None, max_top_k: int | None
) -> torch.Tensor:
    """Top-k then top-p in place with torch operations only: `torch.topk` candidates when every row
    has a top-k and max_top_k is known on the host, else the sort-based reference."""
    if k is not None and max_top_k is not None and max_top_k < logits.shape[-1]:
        return apply_top_k_top_p_topk(logits, k, p, max_top_k)
    return apply_top_k_top_p_reference(logits, k, p)


def apply_top_k_top_p_topk(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor | None, max_top_k: int) -> torch.Tensor:
    """Top-k then top-p in place, for batches where every row has 0 < k <= max_top_k < V:
    `torch.topk(max_top_k)` instead of sorting the vocabulary, no host sync (max_top_k is a host
    int the caller knows). Every token strictly above a row's k-th value is among its top
    max_top_k, which is all top-p needs to find the cut."""
    values, indices = logits.topk(max_top_k, dim=-1)
    kth = values.gather(1, k.to(torch.int64).sub(1).unsqueeze(1))
    logits.masked_fill_(logits < kth, float("-inf"))
    if p is not None:
        probs = logits.softmax(dim=-1)
        candidates = probs.gather(1, indices).sort(dim=-1, descending=True).values  # max_top_k per row: cheap
        threshold = top_p_threshold(candidates, p)
        logits.masked_fill_(probs < threshold, float("-inf"))
    return logits
