"""numba kernels for the CPU backend.

Kernels work on integer views of the logits and write the -inf bit pattern of the logits' dtype,
so one compiled kernel serves float32 (int32 view) and float16/bfloat16 (int16 view) alike.
"""
from __future__ import annotations

import numba
import numpy as np
import torch

# Tokens per parallel work item: 128 words of the bitmask. Small enough that one row of 128k
# tokens spreads over both cores, large enough that scheduling overhead stays negligible.
_CHUNK_WORDS = 128

NEG_INF_BITS = {
    torch.float32: np.int32(np.float32(-np.inf).view(np.int32)),
    torch.float16: np.int16(np.float16(-np.inf).view(np.int16)),
    torch.bfloat16: np.int16(-128),  # 0xFF80: sign 1, exponent all ones, mantissa 0
}
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


@numba.njit(parallel=True, cache=True, nogil=True, boundscheck=False)
def _apply_bitmask_kernel(bits, bitmask, logit_rows, mask_rows, vocab_size, neg_inf):  # pragma: no cover - jitted
    num_words = (vocab_size + 31) // 32
    chunks_per_row = (num_words + _CHUNK_WORDS - 1) // _CHUNK_WORDS
    for item in numba.prange(logit_rows.shape[0] * chunks_per_row):
        r = item // chunks_per_row
        lr = logit_rows[r]
        mr = mask_rows[r]
        w_start = (item % chunks_per_row) * _CHUNK_WORDS
        w_end = min(w_start + _CHUNK_WORDS, num_words)
        for w in range(w_start, w_end):
            word = bitmask[mr, w]
            if word == -1:  # all 32 tokens allowed: the common case for loose grammars
                continue
            base = w * 32
            end = min(base + 32, vocab_size)
            if word == 0:
                bits[lr, base:end] = neg_inf  # a slice store vectorises; a scalar loop does not
            else:
                for t in range(base, end):
                    if (word >> (t - base)) & 1 == 0:
                        bits[lr, t] = neg_inf


def apply_token_bitmask_cpu(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None, vocab_size: int
) -> None:
    """In-place bitmask apply on CPU tensors (2-D, validated); same semantics as the reference."""
    bits = logits.view(INT_VIEW[logits.dtype]).numpy()
    masks = bitmask.numpy()
    if rows is None:
        row_ids = np.arange(logits.shape[0], dtype=np.int64)
    else:
        row_ids = rows.to(torch.int64).numpy()
    _apply_bitmask_kernel(bits, masks, row_ids, row_ids, vocab_size, NEG_INF_BITS[logits.dtype])
