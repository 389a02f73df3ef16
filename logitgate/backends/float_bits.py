"""The bit patterns kernels write: every backend masks logits through an integer view of the same
width and stores the dtype's -inf bits. Kept apart from any kernel module so that loading one
backend's kernels (Triton on a GPU) never loads another's (numba)."""
from __future__ import annotations

import numpy as np
import torch

NEG_INF_BITS = {
    torch.float32: np.int32(np.float32(-np.inf).view(np.int32)),
    torch.float16: np.int16(np.float16(-np.inf).view(np.int16)),
    torch.bfloat16: np.int16(-128),  # 0xFF80: sign 1, exponent all ones, mantissa 0
}
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
