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


# ---- v2 (LOGITGATE_CUDA_KERNELS=bitmask=v2): one tile per program, per-lane bits ----
#
# Every lane reads the word that holds its own bit (`word[offs >> 5] >> (offs & 31)`; the 32 lanes
# of a word hit one address, served by one transaction), so no (words, 32) mask is built and
# reshaped through shared memory. A tile then costs what its bits need: nothing when every token
# is allowed, a store of -inf without a read when none is, a predicated store when few lanes are
# blocked, and otherwise a vector load, select and full store, which writes whole sectors (a
# predicated store of scattered lanes writes partial sectors, which DRAM turns into
# read-modify-writes, and 16-bit lanes one at a time).

# A tile with fewer blocked lanes than 1 / SPARSE_STORE_FRACTION of its lanes gets a predicated store.
SPARSE_STORE_FRACTION = 16
TILE_BYTES = 16384  # 4096 float32 or 8192 bf16/fp16 tokens per program


@triton.jit
def _apply_token_bitmask_tile_kernel(
    bits_ptr,
    bitmask_ptr,
    rows_ptr,
    vocab_size,
    tiles_per_row,
    logits_row_stride,
    bitmask_row_stride,
    neg_inf_bits,
    HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    SPARSE: tl.constexpr,
):
    pid = tl.program_id(0)
    r = pid // tiles_per_row
    if HAS_ROWS:
        row = tl.load(rows_ptr + r).to(tl.int64)
    else:
        row = r.to(tl.int64)
    start = (pid % tiles_per_row) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    inside = offs < vocab_size
    words = tl.load(bitmask_ptr + row * bitmask_row_stride + (offs >> 5), mask=inside, other=-1)
    allowed = ((words >> (offs & 31)) & 1) != 0
    blocked = inside & ~allowed
    num_blocked = tl.sum(blocked.to(tl.int32), axis=0)
    num_inside = tl.minimum(vocab_size - start, BLOCK)
    ptrs = bits_ptr + row * logits_row_stride + offs
    if num_blocked == num_inside:
        tl.store(ptrs, neg_inf_bits.to(bits_ptr.dtype.element_ty), mask=inside)
    elif num_blocked * SPARSE < num_inside:
        if num_blocked > 0:
            tl.store(ptrs, neg_inf_bits.to(bits_ptr.dtype.element_ty), mask=blocked)
    else:
        x = tl.load(ptrs, mask=inside, other=0)
        tl.store(ptrs, tl.where(allowed, x, neg_inf_bits.to(bits_ptr.dtype.element_ty)), mask=inside)


def apply_token_bitmask_tiles_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None, vocab_size: int, *, num_warps: int = 8
) -> None:
    """In-place apply on 2-D validated tensors, one program per (row, tile of TILE_BYTES)."""
    num_rows = logits.shape[0] if rows is None else rows.numel()
    if num_rows == 0 or vocab_size == 0:
        return
    block = min(TILE_BYTES // logits.element_size(), max(32, triton.next_power_of_2(vocab_size)))
    tiles_per_row = triton.cdiv(vocab_size, block)
    bits = logits.view(INT_VIEW[logits.dtype])
    _apply_token_bitmask_tile_kernel[(num_rows * tiles_per_row,)](
        bits,
        bitmask,
        rows if rows is not None else bitmask,  # unused when HAS_ROWS is False
        vocab_size,
        tiles_per_row,
        logits.stride(0),
        bitmask.stride(0),
        int(NEG_INF_BITS[logits.dtype]),
        HAS_ROWS=rows is not None,
        BLOCK=block,
        SPARSE=SPARSE_STORE_FRACTION,
        num_warps=num_warps,
    )
