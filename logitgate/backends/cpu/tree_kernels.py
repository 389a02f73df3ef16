"""numba kernels for tree candidates on the CPU backend: the sparse sampling layout (gather each
row's allowed logits) and candidate-only masking (fill a row with -inf, put its allowed logits
back), and the greedy token over a row's candidates (gather into a scratch row, then the
sampler's own argmax row kernel). Semantics: backends/reference/tree.py (gather_candidate_logits_reference,
keep_candidate_logits_reference, candidate_argmax_reference). Work per row is its number of candidates (plus the padding of
the layout, or the -inf fill of the row), never a bitmask over the vocabulary."""
from __future__ import annotations

import numba
import numpy as np
import torch

from .sampling_kernels import (
    _NUM_BUCKETS,
    _block_sum,
    _exp_nonpositive,
    _fallback_token,
    _inverse_cdf_row,
    _row_argmax,
    _top_k_row,
    _top_p_row,
)
from .threads import numba_thread_cap, thread_cap

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
def _sample_row(logits, row, start, width, allow_tok, temperature, greedy, k, p, u, values, value_bits, probs, prob_bits, mass):  # pragma: no cover - jitted
    """The column drawn for one row of the sparse layout, in one pass per stage over the row's own
    candidates (no padding): gather, then the sampler's stages with its row kernels (argmax; top-k;
    exp; top-p; inverse CDF). values/value_bits and probs/prob_bits are float32/int32 views of
    two scratch rows; mass the top-p histogram (all zero, left all zero)."""
    if width == 0:
        return 0
    vals = values[:width]
    if greedy:
        for j in range(width):
            vals[j] = logits[row, allow_tok[start + j]]
        return _row_argmax(vals, value_bits[:width])
    # Gather and temperature (float32, as the sampler divides), tracking the peak: a NaN or an
    # infinite peak (nothing above -inf included) leaves the row without a distribution.
    peak = -np.inf
    nan = False
    for j in range(width):
        x = logits[row, allow_tok[start + j]] / temperature
        vals[j] = x
        nan |= x != x
        peak = max(peak, x)
    if nan or not (-np.inf < peak < np.inf):
        return _fallback_token(vals)
    _top_k_row(vals, value_bits[:width], k)  # keeps the peak
    # The softmax up to its normaliser: top-p compares mass with p times the total instead, and
    # the inverse CDF scales u by the total.
    row_probs = probs[:width]
    peak32 = np.float32(peak)
    for j in range(width):
        row_probs[j] = _exp_nonpositive(vals[j] - peak32)
    if p < 1.0:
        # Top-p zeroes the probabilities it removes. vals is dead now: it serves as the filter's
        # members scratch (read before the cut) and takes the cut's -inf writes.
        _top_p_row(vals, row_probs, prob_bits[:width], p * _block_sum(row_probs, 0, width), mass, values)
    return _inverse_cdf_row(row_probs, u)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _sample_rows(logits, rows, starts, widths, allow_tok, temperature, greedy, k, p, u, out, first, step, max_width):  # pragma: no cover - jitted
    # Rows first, first + step, ...: one set of scratch rows and one histogram for all of them.
    values = np.empty(max(max_width, 1), np.float32)
    probs = np.empty(max(max_width, 1), np.float32)
    mass = np.zeros(_NUM_BUCKETS, np.float64)
    for i in range(first, rows.shape[0], step):
        column = _sample_row(
            logits, rows[i], starts[i], widths[i], allow_tok, temperature[i], greedy[i], k[i], p[i], u[i],
            values, values.view(np.int32), probs, probs.view(np.int32), mass,
        )
        out[i] = allow_tok[starts[i] + column] if widths[i] > 0 else 0


@numba.njit(parallel=True, cache=True, nogil=True, boundscheck=False)
def _sample_parallel(logits, rows, starts, widths, allow_tok, temperature, greedy, k, p, u, out, chunks, max_width):  # pragma: no cover - jitted
    for c in numba.prange(chunks):
        _sample_rows(logits, rows, starts, widths, allow_tok, temperature, greedy, k, p, u, out, c, chunks, max_width)


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
    # The plan's index tensors are contiguous int64 already: no conversion calls (a few us each,
    # and a narrow tree's whole step is ~0.1 ms).
    if t.dtype == torch.int64 and t.is_contiguous():
        return t.numpy()
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
        with numba_thread_cap(thread_cap()):
            _argmax_parallel(*args, max(width, 1), out.numpy())
    return out


def sample_candidates_cpu(logits, rows, starts, widths, allow_tok, width, temperature, greedy, top_k, top_p, uniform) -> torch.Tensor:
    """int64 (n,), as sample_candidates_reference; logits float32 with unit column stride."""
    n = rows.shape[0]
    out = torch.empty(n, dtype=torch.int64)
    if n == 0:
        return out
    if width == 0:
        return out.zero_()
    per_row = (
        _int64(rows), _int64(starts), _int64(widths), allow_tok.contiguous().numpy(),
        temperature.to(torch.float32).contiguous().numpy(),
        (greedy if greedy is not None else torch.zeros(n, dtype=torch.bool)).contiguous().numpy(),
        _int64(top_k) if top_k is not None else np.zeros(n, np.int64),
        top_p.to(torch.float64).contiguous().numpy() if top_p is not None else np.ones(n, np.float64),
        uniform.to(torch.float64).contiguous().numpy(),
    )
    if n * width <= _SERIAL_MAX_VALUES:
        _sample_rows(logits.numpy(), *per_row, out.numpy(), 0, 1, width)
    else:
        with numba_thread_cap(thread_cap()):
            chunks = max(1, min(n, numba.get_num_threads()))  # one histogram and scratch per thread
            _sample_parallel(logits.numpy(), *per_row, out.numpy(), chunks, width)
    return out
