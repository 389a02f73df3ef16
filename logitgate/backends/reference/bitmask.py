"""The torch reference of applying a token bitmask to logits (xgrammar's apply_token_bitmask_inplace).
"""
from __future__ import annotations

import torch

from ..formats import unpack_bitmask


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

