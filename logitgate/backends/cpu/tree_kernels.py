"""numba kernels for tree candidates on the CPU backend: the sparse sampling layout (gather each
row's allowed logits) and candidate-only masking (fill a row with -inf, put its allowed logits
back), and the greedy token over a row's candidates (gather into a scratch row, then the
sampler's own argmax row kernel). Semantics: backends/reference.py (gather_candidate_logits_reference,
keep_candidate_logits_reference, candidate_argmax_reference). Work per row is its number of candidates (plus the padding of
the layout, or the -inf fill of the row), never a bitmask over the vocabulary."""
from __future__ import annotations

import numba
import numpy as np
import torch

from .sampling_kernels import _row_argmax

# Below this many gathered values a serial loop beats the parallel launch.
_SERIAL_MAX_VALUES = 1 << 15


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _gather_row(logits, row, start, width, allow_tok, out_row):  # pragma: no cover - jitted
    for j in range(width):
        out_row[j] = logits[row, allow_tok[start + j]]
    for j in range(width, out_row.shape[0]):
        out_row[j] = -np.inf


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _gather_serial(logits, rows, starts, widths, allow_tok, out):  # pragma: no cover - jitted
    for i in range(rows.shape[0]):
        _gather_row(logits, rows[i], starts[i], widths[i], allow_tok, out[i])


@numba.njit(parallel=True, cache=True, nogil=True, boundscheck=False)
def _gather_parallel(logits, rows, starts, widths, allow_tok, out):  # pragma: no cover - jitted
    for i in numba.prange(rows.shape[0]):
        _gather_row(logits, rows[i], starts[i], widths[i], allow_tok, out[i])


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _argmax_row(logits, row, start, width, allow_tok, scratch, bits):  # pragma: no cover - jitted
    # scratch and bits are the same memory (float32 and int32 views): _row_argmax reads both.
    if width == 0:
        return 0  # the dense argmax of an all -inf row
    for j in range(width):
        scratch[j] = logits[row, allow_tok[start + j]]
    return allow_tok[start + _row_argmax(scratch[:width], bits[:width])]


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _argmax_serial(logits, rows, starts, widths, allow_tok, scratch, bits, out):  # pragma: no cover - jitted
    for i in range(rows.shape[0]):
        out[i] = _argmax_row(logits, rows[i], starts[i], widths[i], allow_tok, scratch, bits)


@numba.njit(parallel=True, cache=True, nogil=True, boundscheck=False)
def _argmax_parallel(logits, rows, starts, widths, allow_tok, max_width, out):  # pragma: no cover - jitted
    for i in numba.prange(rows.shape[0]):
        scratch = np.empty(max_width, np.float32)
        out[i] = _argmax_row(logits, rows[i], starts[i], widths[i], allow_tok, scratch, scratch.view(np.int32))


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _keep_row(logits, row, start, width, allow_tok, saved):  # pragma: no cover - jitted
    for j in range(width):
        saved[j] = logits[row, allow_tok[start + j]]
    logits[row, :] = -np.inf
    for j in range(width):
        logits[row, allow_tok[start + j]] = saved[j]


@numba.njit(parallel=True, cache=True, nogil=True, boundscheck=False)
def _keep_kernel(logits, rows, starts, widths, allow_tok, max_width):  # pragma: no cover - jitted
    for i in numba.prange(rows.shape[0]):
        saved = np.empty(max_width, logits.dtype)
        _keep_row(logits, rows[i], starts[i], widths[i], allow_tok, saved)


def _int64(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.int64).contiguous().numpy()


def gather_candidate_logits_cpu(logits, rows, starts, widths, allow_tok, width) -> torch.Tensor:
    """float32 (n, width), as gather_candidate_logits_reference; logits float32 (other dtypes are
    converted row by row by the caller's backend)."""
    out = torch.empty((rows.shape[0], width), dtype=torch.float32)
    if rows.shape[0] == 0 or width == 0:
        return out
    kernel = _gather_serial if rows.shape[0] * width <= _SERIAL_MAX_VALUES else _gather_parallel
    kernel(logits.numpy(), _int64(rows), _int64(starts), _int64(widths), allow_tok.contiguous().numpy(), out.numpy())
    return out


def keep_candidate_logits_cpu(logits, rows, starts, widths, allow_tok, width) -> None:
    """In place on float32 (B, V) logits, as keep_candidate_logits_reference."""
    if rows.shape[0] == 0:  # width 0: the rows become all -inf
        return
    _keep_kernel(logits.numpy(), _int64(rows), _int64(starts), _int64(widths), allow_tok.contiguous().numpy(), width)


def candidate_argmax_cpu(logits, rows, starts, widths, allow_tok, width) -> torch.Tensor:
    """int64 (n,), as candidate_argmax_reference; logits float32. No (n, width) layout is written:
    each row is gathered into a scratch row and reduced there."""
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    if rows.shape[0] == 0:
        return out
    args = (logits.numpy(), _int64(rows), _int64(starts), _int64(widths), allow_tok.contiguous().numpy())
    if rows.shape[0] * width <= _SERIAL_MAX_VALUES:
        scratch = np.empty(max(width, 1), np.float32)
        _argmax_serial(*args, scratch, scratch.view(np.int32), out.numpy())
    else:
        _argmax_parallel(*args, max(width, 1), out.numpy())
    return out
