"""Launch sizing for the Triton kernels: CUDA (many SMs, big grids) vs Ascend (a few vector cores,
each with a 192 KB unified buffer that one block's working set must fit)."""
from __future__ import annotations

ASCEND_UB_BYTES = 192 * 1024


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def prev_power_of_2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def ascend_grid_and_block(batch_size: int, vector_cores: int) -> tuple[int, int]:
    """Rows-per-program launch for per-request kernels: grid = min(B, cores),
    block = next power of two of ceil(B / grid) (vllm-ascend's cal_grid_and_block_size)."""
    if batch_size <= vector_cores:
        return max(batch_size, 1), 1
    return vector_cores, next_power_of_2(-(-batch_size // vector_cores))


def ascend_vocab_tile(bytes_per_token: int, ub_bytes: int = ASCEND_UB_BYTES, lo: int = 1024, hi: int = 16384) -> int:
    """Largest power-of-two tile of tokens whose working set (bytes_per_token each), double-buffered,
    fits the unified buffer."""
    return max(lo, min(hi, prev_power_of_2(ub_bytes // (2 * bytes_per_token))))
