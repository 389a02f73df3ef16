"""Exp(1) noise generated inside Triton kernels from a per-row Philox seed (the v2 CUDA kernels).

The noise of token t in a row whose seed is s is a function of (s, t) alone: Philox-4x32-10 keyed by
the 64-bit seed, counter t, one 32-bit draw r; u = (r + 1/2) / 2^32 is the midpoint of one of 2^32
equally likely bins of (0, 1), and q = -log(1 - u) its exponential quantile. Computed as the
series u + u^2/2 + ... + u^7/7 for u < 1/16 (where 1 - u would round) and as -log(w) with
w = (~r + 1/2) / 2^32 = 1 - u otherwise, q is within ~2e-6 relative of the exact quantile over its
whole range (the fast log's error included), never 0 (min ~1.2e-10) and never inf (max ~22.9):
an exponential race argmax(p / q) over it is an exact draw up to that binning and rounding
(torch's float32 exponential_ on CUDA clamps q at 6e-8, which favours rare tokens in large
supports). A kernel that needs the noise of token t calls
`exponential_noise(seed, t)`; `philox_exponential_triton` writes it out for tests and references.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..sampling_rules import PHILOX_SEED_HIGH as SEED_HIGH  # noqa: F401 - seeds are uniform in [0, SEED_HIGH)


@triton.jit
def exponential_noise(seed, offsets):
    """float32 Exp(1) draws for token ids `offsets` (int32) of the row keyed by `seed` (int64)."""
    r = tl.randint(seed, offsets)  # uint32
    u = (r.to(tl.float32) + 0.5) * 2.3283064365386963e-10
    w = ((~r).to(tl.float32) + 0.5) * 2.3283064365386963e-10
    series = u * (1.0 + u * (0.5 + u * (0.3333333432674408 + u * (0.25 + u * (0.2 + u * (0.1666666716337204 + u * 0.1428571492433548))))))
    return tl.where(u < 0.0625, series, -tl.log(w))


@triton.jit
def _philox_exponential_kernel(seed_ptr, out_ptr, vocab_size, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seed_ptr + row)
    tl.store(out_ptr + row.to(tl.int64) * out_stride + offs, exponential_noise(seed, offs), mask=offs < vocab_size)


def philox_exponential_triton(seeds: torch.Tensor, vocab_size: int, *, block: int = 1024) -> torch.Tensor:
    """float32 (B, vocab_size): the noise the v2 kernels use for rows seeded with `seeds` (int64 (B,))."""
    out = torch.empty((seeds.numel(), vocab_size), dtype=torch.float32, device=seeds.device)
    if out.numel():
        block = min(block, max(16, triton.next_power_of_2(vocab_size)))
        _philox_exponential_kernel[(seeds.numel(), triton.cdiv(vocab_size, block))](
            seeds.contiguous(), out, vocab_size, out.stride(0), BLOCK=block
        )
    return out
