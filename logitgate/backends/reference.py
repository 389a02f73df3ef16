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
