"""Triton kernels: top-k and top-p without sorting the vocabulary and without a host sync.

Each program owns whole rows (grid-stride over rows: one row per program on CUDA, rows spread over
the vector cores on Ascend) and finds the row's cut by bisection over the float32 bit patterns,
each step one pass over the row that counts (top-k) or sums (top-p) what lies above the candidate:
32 passes give the exact k-th largest value, 31 the exact smallest kept probability (probabilities
are non-negative, so their bits order like their values). Then one pass writes the -inf.
Semantics are the reference's (backends/reference/sampling.py); top-p sums in float32, as vLLM's own
float32 cumulative sum does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Bytes one token occupies in a tile: the float32 value, its int32 key or bits, the comparison and
# the selected value (sizes Ascend tiles for the 192 KB unified buffer).
BYTES_PER_TOKEN = 4 + 4 + 1 + 4


@triton.jit
def _ordered_key(bits):
    # Negative floats order backwards in two's complement: flipping their magnitude bits makes
    # integer order equal float order (-inf lowest, +inf highest).
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _top_k_kernel(logits_ptr, k_ptr, num_rows, vocab_size, row_stride, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    for row in tl.range(pid, num_rows, num_programs):
        k = tl.load(k_ptr + row).to(tl.int64)
        base = logits_ptr + tl.cast(row, tl.int64) * row_stride
        if (k > 0) & (k < vocab_size):
            # Largest key t with count(key >= t) >= k: the key of the k-th largest logit.
            lo = tl.full((), -2147483648, tl.int64)
            hi = tl.full((), 2147483647, tl.int64)
            for _ in range(32):
                mid = lo + (hi - lo + 1) // 2
                pivot = mid.to(tl.int32)  # within int32; only hi - lo + 1 needs 64 bits
                count = tl.zeros((), tl.int32)
                for start in range(0, vocab_size, BLOCK):
                    offsets = start + tl.arange(0, BLOCK)
                    x = tl.load(base + offsets, mask=offsets < vocab_size, other=float("-inf"))
                    key = _ordered_key(x.to(tl.int32, bitcast=True))
                    count += tl.sum(((key >= pivot) & (offsets < vocab_size)).to(tl.int32), axis=0)
                take = count >= k
                lo = tl.where(take, mid, lo)
                hi = tl.where(take, hi, mid - 1)
            kth = _ordered_key(lo.to(tl.int32)).to(tl.float32, bitcast=True)
            for start in range(0, vocab_size, BLOCK):
                offsets = start + tl.arange(0, BLOCK)
                inside = offsets < vocab_size
                x = tl.load(base + offsets, mask=inside, other=0.0)
                tl.store(base + offsets, float("-inf"), mask=inside & (x < kth))


@triton.jit
def _top_p_kernel(logits_ptr, probs_ptr, p_ptr, num_rows, vocab_size, logits_stride, probs_stride, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    for row in tl.range(pid, num_rows, num_programs):
        top_p = tl.load(p_ptr + row)
        probs_row = probs_ptr + tl.cast(row, tl.int64) * probs_stride
        logits_row = logits_ptr + tl.cast(row, tl.int64) * logits_stride
        if top_p < 1.0:  # NaN: False, the row is left alone (as the reference)
            top_p = tl.maximum(top_p, 1e-30)  # p <= 0 keeps the most likely tokens, as the smallest p does
            # Smallest bit pattern t whose mass strictly above, sum(p_j > t), is < top_p: that t is
            # a probability of the row (or 0), and top-p keeps exactly the tokens with p >= t.
            lo = tl.full((), 0, tl.int32)
            hi = tl.full((), 0x7F800000, tl.int32)  # +inf: nothing above it
            for _ in range(31):
                mid = lo + (hi - lo) // 2
                mass = tl.zeros((), tl.float32)
                for start in range(0, vocab_size, BLOCK):
                    offsets = start + tl.arange(0, BLOCK)
                    q = tl.load(probs_row + offsets, mask=offsets < vocab_size, other=0.0)
                    mass += tl.sum(tl.where(q.to(tl.int32, bitcast=True) > mid, q, 0.0), axis=0)
                below = mass < top_p
                hi = tl.where(below, mid, hi)
                lo = tl.where(below, lo, mid + 1)
            threshold = hi.to(tl.float32, bitcast=True)
            for start in range(0, vocab_size, BLOCK):
                offsets = start + tl.arange(0, BLOCK)
                inside = offsets < vocab_size
                q = tl.load(probs_row + offsets, mask=inside, other=1.0)
                tl.store(logits_row + offsets, float("-inf"), mask=inside & (q < threshold))


def apply_top_k_top_p_triton(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None, *, block: int, max_programs: int
) -> torch.Tensor:
    """Top-k then top-p in place on float32 (B, V) logits (last dimension contiguous)."""
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return logits
    grid = (max(1, min(num_rows, max_programs)),)
    if k is not None:
        _top_k_kernel[grid](logits, k.to(torch.int64).contiguous(), num_rows, vocab_size, logits.stride(0), BLOCK=block)
    if p is not None:
        probs = logits.softmax(dim=-1)
        _top_p_kernel[grid](
            logits, probs, p.to(torch.float32).contiguous(), num_rows, vocab_size, logits.stride(0), probs.stride(0), BLOCK=block
        )
    return logits
