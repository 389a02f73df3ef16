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


def gather_csr_rows(
    states: torch.Tensor, starts: torch.Tensor, widths: torch.Tensor, values: torch.Tensor, max_width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a CSR table, padded: out[r, k] = values[starts[s] + k] for k < widths[s], s = states[r].

    Returns (out (B, max_width), valid (B, max_width) bool). Padding repeats the row's first entry, so
    the ids stay usable as gather indices; every state must have starts[s] < len(values).
    """
    offs = torch.arange(max_width, device=states.device)
    first = starts[states].unsqueeze(1)
    valid = offs < widths[states].unsqueeze(1)
    return values[torch.where(valid, first + offs, first)], valid


def fill_tree_bitmask_reference(
    bitmask: torch.Tensor,
    states: torch.Tensor,
    allow_start: torch.Tensor,
    allow_tok: torch.Tensor,
    fill_width: torch.Tensor,
    max_width: int,
    dense_rows: torch.Tensor | None = None,
    dense_slot: torch.Tensor | None = None,
) -> None:
    """bitmask[r] (int32 (B, W), contiguous) := the allowed set of tree state s = states[r]: the
    precomputed row dense_rows[dense_slot[s]] (row 0 is all zero; the rows may cover fewer words than
    W, the rest is zeroed) plus the bits of allow_tok[allow_start[s] : allow_start[s] + fill_width[s]].
    A state has either a dense row or a sparse list (fill_width 0), and its tokens are distinct, so
    adding the bits equals OR-ing them."""
    rows, words = bitmask.shape
    if dense_rows is None:
        bitmask.zero_()
    elif dense_rows.shape[1] == words:
        torch.index_select(dense_rows, 0, dense_slot[states], out=bitmask)
    else:
        bitmask[:, : dense_rows.shape[1]] = dense_rows[dense_slot[states]]
        bitmask[:, dense_rows.shape[1] :] = 0
    if max_width == 0 or rows == 0:
        return
    tok, valid = gather_csr_rows(states, allow_start, fill_width, allow_tok, max_width)
    tok = tok.long()
    bits = torch.where(valid, torch.ones_like(tok) << (tok & (BITS_PER_WORD - 1)), 0)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)  # bit 31 -> negative int32
    index = torch.arange(rows, device=bitmask.device).unsqueeze(1) * words + (tok >> 5)
    bitmask.view(-1).scatter_add_(0, index.reshape(-1), bits.reshape(-1))
