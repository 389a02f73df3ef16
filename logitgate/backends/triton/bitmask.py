"""Triton kernel: apply an int32 token bitmask to logits in place.

The kernel writes through an integer view of the logits (int32 for float32, int16 for the 16-bit
floats) and stores the -inf bit pattern: one kernel for every float dtype, no float conversion,
and it sidesteps the interpreter's missing bfloat16 arithmetic. Programs walk the (row, vocab tile)
work items with a grid-stride loop, so the same kernel runs one tile per program on CUDA and a few
long-lived programs, one per vector core, on Ascend.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..float_bits import INT_VIEW, NEG_INF_BITS


@triton.jit
def _apply_token_bitmask_kernel(
    bits_ptr,
    bitmask_ptr,
    rows_ptr,
    num_rows,
    vocab_size,
    logits_row_stride,
    bitmask_row_stride,
    neg_inf_bits,
    HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    tiles_per_row = tl.cdiv(vocab_size, BLOCK)
    num_words = tl.cdiv(vocab_size, 32)
    for work in tl.range(pid, num_rows * tiles_per_row, num_programs):
        r = work // tiles_per_row
        if HAS_ROWS:
            row = tl.load(rows_ptr + r).to(tl.int64)
        else:
            row = r.to(tl.int64)
        start = (work % tiles_per_row) * BLOCK
        word_ids = start // 32 + tl.arange(0, BLOCK // 32)
        words = tl.load(bitmask_ptr + row * bitmask_row_stride + word_ids, mask=word_ids < num_words, other=-1)
        blocked = ((words[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0
        blocked = tl.reshape(blocked, (BLOCK,))
        offsets = start + tl.arange(0, BLOCK)
        tl.store(bits_ptr + row * logits_row_stride + offsets, neg_inf_bits, mask=blocked & (offsets < vocab_size))


def apply_token_bitmask_triton(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    rows: torch.Tensor | None,
    vocab_size: int,
    *,
    block: int,
    max_programs: int,
) -> None:
    """In-place apply on 2-D validated tensors; `block` tokens per tile, at most `max_programs` programs."""
    num_rows = logits.shape[0] if rows is None else rows.numel()
    if num_rows == 0:
        return
    tiles = num_rows * triton.cdiv(vocab_size, block)
    grid = (max(1, min(tiles, max_programs)),)
    bits = logits.view(INT_VIEW[logits.dtype])
    _apply_token_bitmask_kernel[grid](
        bits,
        bitmask,
        rows if rows is not None else bitmask,  # unused when HAS_ROWS is False
        num_rows,
        vocab_size,
        logits.stride(0),
        bitmask.stride(0),
        int(NEG_INF_BITS[logits.dtype]),
        HAS_ROWS=rows is not None,
        BLOCK=block,
    )
