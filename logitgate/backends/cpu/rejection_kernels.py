"""numba kernels for rejection sampling on the CPU backend.

They exploit what a CPU does well: one request's drafts are verified serially, so a row is read
only when it is needed (rows after the first rejection never are), the acceptance test needs one
logsumexp per row and never a written softmax, and the recovered token is drawn from the single
rejected row by inverse CDF with one uniform per request. Semantics: reference/rejection.py.
"""
from __future__ import annotations

import math

import numba
import numpy as np
import torch

# Reassociation lets LLVM vectorise the reductions; no 'nnan'/'ninf', because NaN and -inf rows
# must behave as in the reference (reject, zero weight), and no 'arcp', because logits / T must be
# the same float32 division the reference does.
_FAST = {"reassoc", "nsz", "contract", "afn"}

# exp for x <= 0 as 2^k * poly(r): numba has no vectorised exp without Intel SVML (absent here),
# and a scalar libm call per token made the logsumexp 2x slower than torch's softmax.
_POW2 = np.array([2.0**k for k in range(-126, 1)], dtype=np.float32)
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 split so that k * _LN2_HI is exact (Cody-Waite)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_UNDERFLOW = np.float32(-87.0)  # below this exp(x) is (sub)normal noise; return exactly 0


@numba.njit(fastmath=_FAST, cache=True, nogil=True)
def exp_nonpositive(x):  # pragma: no cover - jitted
    """float32 exp(x) for x <= 0, relative error < 5e-7; exactly 0 for x < -87 (so -inf gives 0);
    NaN gives NaN."""
    k = np.floor(x * _LOG2E + np.float32(0.5))
    k = k if k > np.float32(-126.0) else np.float32(-126.0)  # also maps NaN to a safe index
    k = k if k < np.float32(0.0) else np.float32(0.0)
    r = x - k * _LN2_HI - k * _LN2_LO
    p = np.float32(1.0) + r * (
        np.float32(1.0)
        + r * (np.float32(0.5) + r * (np.float32(1 / 6) + r * (np.float32(1 / 24) + r * (np.float32(1 / 120) + r * np.float32(1 / 720)))))
    )
    e = p * _POW2[np.int32(k) + 126]
    return np.float32(0.0) if x < _EXP_UNDERFLOW else e


@numba.njit(fastmath=_FAST, cache=True, nogil=True)
def _row_lse(row, temperature):  # pragma: no cover - jitted
    """logsumexp(row / temperature) with float64 accumulation; NaN anywhere gives NaN, an all -inf
    row gives -inf."""
    peak = np.float32(-np.inf)
    for j in range(row.shape[0]):
        z = row[j] / temperature
        peak = z if z > peak else peak
    if peak == -np.inf:
        return -np.inf
    total = 0.0
    for j in range(row.shape[0]):
        total += np.float64(exp_nonpositive(row[j] / temperature - peak))
    return np.float64(peak) + math.log(total)


@numba.njit(cache=True, nogil=True)
def _row_argmax(row):  # pragma: no cover - jitted
    """torch.argmax semantics: the first NaN if there is one, else the first maximum."""
    peak = row[0]
    has_nan = False
    for j in range(row.shape[0]):
        v = row[j]
        peak = v if v > peak else peak
        has_nan |= v != v
    for j in range(row.shape[0]):
        v = row[j]
        if (v != v) if has_nan else (v == peak):
            return j
    return 0


@numba.njit(cache=True, nogil=True)
def _row_fallback(row, temperature):  # pragma: no cover - jitted
    """The fallback token of a row without a distribution (sampling_rules.fallback_tokens): the first
    maximum of row / temperature with NaN ignored, 0 when nothing is above -inf."""
    best = -np.inf
    chosen = 0
    for j in range(row.shape[0]):
        z = row[j] / temperature
        if z > best:
            best = z
            chosen = j
    return chosen


@numba.njit(parallel=True, cache=True, nogil=True)
def _greedy_accept_kernel(cu, drafts, logits, active, accepted, correction):  # pragma: no cover - jitted
    for r in numba.prange(cu.shape[0]):
        accepted[r] = 0
        correction[r] = 0
        if not active[r]:
            continue
        start = cu[r - 1] if r > 0 else 0
        count = 0
        for i in range(start, cu[r]):
            best = _row_argmax(logits[i])
            if drafts[i] != best:
                correction[r] = best
                break
            count += 1
        accepted[r] = count


@numba.njit(parallel=True, cache=True, nogil=True)
def _random_accept_kernel(
    cu, drafts, logits, temperature, draft_probs, has_draft_probs, uniform, active, accepted, row_lse
):  # pragma: no cover - jitted
    vocab = logits.shape[1]
    for r in numba.prange(cu.shape[0]):
        accepted[r] = 0
        row_lse[r] = 0.0
        if not active[r]:
            continue
        start = cu[r - 1] if r > 0 else 0
        count = 0
        for i in range(start, cu[r]):
            lse = _row_lse(logits[i], temperature[i])
            x = drafts[i]
            ok = False
            if 0 <= x < vocab:
                if math.isfinite(lse):
                    target_p = math.exp(np.float64(logits[i, x] / temperature[i]) - lse)
                else:  # no distribution: a point mass on the fallback token
                    target_p = 1.0 if x == _row_fallback(logits[i], temperature[i]) else 0.0
                draft_p = np.float64(draft_probs[i, x]) if has_draft_probs else 1.0
                ok = draft_p > 0 and target_p > 0 and target_p / draft_p >= uniform[i]
            if not ok:
                row_lse[r] = lse
                break
            count += 1
        accepted[r] = count


_SEARCH_BLOCK = 256  # tokens per block of the inverse-CDF search (block sums skip most of the row)


@numba.njit(fastmath=_FAST, cache=True, nogil=True)
def _target_row(row, temperature, lse, out):  # pragma: no cover - jitted
    """out = softmax(row / temperature) given its logsumexp (NaN -> 0); returns the sum."""
    total = 0.0
    for j in range(row.shape[0]):
        t = exp_nonpositive(row[j] / temperature - lse)
        t = t if t > 0 else np.float32(0.0)
        out[j] = t
        total += np.float64(t)
    return total


@numba.njit(fastmath=_FAST, cache=True, nogil=True)
def _residual_row(row, temperature, lse, dprobs, out):  # pragma: no cover - jitted
    """out = max(softmax(row / temperature) - dprobs, 0) (NaN -> 0); returns the sum."""
    total = 0.0
    for j in range(row.shape[0]):
        t = exp_nonpositive(row[j] / temperature - lse)
        w = (t if t > 0 else np.float32(0.0)) - dprobs[j]
        w = w if w > 0 else np.float32(0.0)
        out[j] = w
        total += np.float64(w)
    return total


@numba.njit(fastmath=_FAST, cache=True, nogil=True)
def _block_sum(weights, start, stop):  # pragma: no cover - jitted
    total = 0.0
    for j in range(start, stop):
        total += np.float64(weights[j])
    return total


@numba.njit(cache=True, nogil=True)
def _inverse_cdf(weights, total, u):  # pragma: no cover - jitted
    """The first token whose cumulative weight exceeds u * total (zero weights never chosen)."""
    vocab = weights.shape[0]
    needle = u * total
    cum = 0.0
    for start in range(0, vocab, _SEARCH_BLOCK):
        stop = min(start + _SEARCH_BLOCK, vocab)
        block = _block_sum(weights, start, stop)
        if cum + block <= needle:
            cum += block
            continue
        for j in range(start, stop):
            w = weights[j]
            if w > 0:
                cum += np.float64(w)
                if cum > needle:
                    return j
    for j in range(vocab - 1, -1, -1):  # u * total rounded up to the total: the last positive weight
        if weights[j] > 0:
            return j
    return 0


@numba.njit(cache=True, nogil=True)
def _recover_row(row, temperature, lse, dprobs, has_draft_probs, x, u):  # pragma: no cover - jitted
    """The recovered token of one rejected row (weights as in recovery_weights_reference)."""
    if not math.isfinite(lse):  # no distribution: a point mass on the fallback token
        return _row_fallback(row, temperature)
    vocab = row.shape[0]
    weights = np.empty(vocab, dtype=np.float32)
    valid = 0 <= x < vocab
    if valid and has_draft_probs:
        total = _residual_row(row, temperature, lse, dprobs, weights)
    else:
        total = _target_row(row, temperature, lse, weights)
        if valid:  # n-gram draft: the target without the drafted token
            weights[x] = 0.0
            # Re-sum rather than subtract: total - p[x] leaves rounding residue where the rest is 0.
            total = _block_sum(weights, 0, vocab)
    if not total > 0:  # nothing left to correct (or NaN): sample the target itself
        total = _target_row(row, temperature, lse, weights)
    if not total > 0:
        return 0
    return _inverse_cdf(weights, total, u)


@numba.njit(parallel=True, cache=True, nogil=True)
def _recover_kernel(
    cu, drafts, logits, temperature, draft_probs, has_draft_probs, accepted, row_lse, uniform, active, out
):  # pragma: no cover - jitted
    for r in numba.prange(cu.shape[0]):
        out[r] = 0
        start = cu[r - 1] if r > 0 else 0
        if not active[r] or start + accepted[r] >= cu[r]:
            continue
        i = start + accepted[r]
        out[r] = _recover_row(
            logits[i], temperature[i], np.float32(row_lse[r]), draft_probs[i if has_draft_probs else 0],
            has_draft_probs, drafts[i], uniform[r],
        )


# ---- torch entry points (2-D contiguous float32 views; inputs validated by the caller) ----


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float32).contiguous().numpy()


def _i64(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.int64).contiguous().numpy()


def _active(active: torch.Tensor | None, batch: int) -> np.ndarray:
    return np.ones(batch, dtype=np.bool_) if active is None else active.contiguous().numpy()


def _temperature(temperature: torch.Tensor | None, rows: int) -> np.ndarray:
    return np.ones(rows, dtype=np.float32) if temperature is None else _f32(temperature)


def _draft_probs(draft_probs: torch.Tensor | None) -> tuple[np.ndarray, bool]:
    if draft_probs is None:
        return np.zeros((1, 1), dtype=np.float32), False
    return _f32(draft_probs), True


def greedy_accept_cpu(cu, draft_token_ids, target_logits, active):
    batch = cu.numel()
    accepted = np.zeros(batch, dtype=np.int32)
    correction = np.zeros(batch, dtype=np.int32)
    _greedy_accept_kernel(_i64(cu), _i64(draft_token_ids), _f32(target_logits), _active(active, batch), accepted, correction)
    return torch.from_numpy(accepted), torch.from_numpy(correction)


def random_accept_cpu(cu, draft_token_ids, target_logits, temperature, draft_probs, uniform, active):
    batch = cu.numel()
    accepted = np.zeros(batch, dtype=np.int32)
    row_lse = np.zeros(batch, dtype=np.float32)
    probs, has_probs = _draft_probs(draft_probs)
    _random_accept_kernel(
        _i64(cu), _i64(draft_token_ids), _f32(target_logits), _temperature(temperature, target_logits.shape[0]),
        probs, has_probs, uniform.to(torch.float64).contiguous().numpy(), _active(active, batch), accepted, row_lse,
    )
    return torch.from_numpy(accepted), torch.from_numpy(row_lse)


def recover_cpu(cu, draft_token_ids, target_logits, temperature, draft_probs, accepted, row_lse, uniform, active):
    batch = cu.numel()
    out = np.zeros(batch, dtype=np.int32)
    probs, has_probs = _draft_probs(draft_probs)
    _recover_kernel(
        _i64(cu), _i64(draft_token_ids), _f32(target_logits), _temperature(temperature, target_logits.shape[0]),
        probs, has_probs, _i64(accepted), _f32(row_lse), uniform.to(torch.float64).contiguous().numpy(),
        _active(active, batch), out,
    )
    return torch.from_numpy(out)
