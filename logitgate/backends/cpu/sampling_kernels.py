"""numba kernels for sampling on the CPU backend: inverse-CDF draws and top-k / top-p filters that
avoid sorting the vocabulary. Semantics are those of the torch reference (backends/reference/sampling.py)."""
from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

# Tokens per block of the inverse-CDF draw: the first pass sums blocks, the second walks one block.
_CDF_BLOCK = 2048
# Top-k values up to this size use a k-element min-heap (one pass); larger k a bucket histogram.
_HEAP_MAX_K = 512
# Top-p histogram: the 12 high bits of a non-negative float32 (exponent + 4 mantissa bits) give
# 4096 buckets ordered like the values, 16 per octave.
_BUCKET_SHIFT = 19
_NUM_BUCKETS = 4096
# Top-k buckets: the 12 high bits of a signed ordered key (sign, exponent, 3 mantissa bits).
_KEY_SHIFT = 20


# exp(x) for x <= 0 in float32 (Cephes' expf: x = k ln 2 + r, |r| <= ln 2 / 2, a degree-7
# polynomial in r, times 2^k built from its bits): within 1 ulp of torch's vectorised exp, and
# branch-free, so LLVM vectorises a loop of it (libm's expf is a call per value, 4-5x slower).
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_C = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))
# Below this, 2^k leaves the normal floats: the result is 0 (torch gives a denormal under 1.2e-38,
# a probability no draw can reach); -inf gives exactly 0.
_EXP_LOW = np.float32(-87.0)


@intrinsic
def _int32_bits_as_float32(typingctx, bits):  # pragma: no cover - compiled
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@numba.njit(inline="always")
def _exp_nonpositive(x):  # pragma: no cover - jitted
    c0, c1, c2, c3, c4, c5 = _EXP_C
    clamped = max(x, _EXP_LOW)
    k = np.floor(clamped * _LOG2E + np.float32(0.5))
    r = clamped - k * _LN2_HI - k * _LN2_LO
    poly = ((((c0 * r + c1) * r + c2) * r + c3) * r + c4) * r + c5
    poly = poly * r * r + r + np.float32(1.0)
    value = poly * _int32_bits_as_float32((np.int32(k) + np.int32(127)) << np.int32(23))
    return np.float32(0.0) if x < _EXP_LOW else value


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _block_sum(row, start, end):  # pragma: no cover - jitted
    # Eight independent float64 accumulators: LLVM vectorises this, not a single running sum
    # (3x faster here), and float64 keeps the cumulative distribution exact to ~1e-16.
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    i = start
    while i + 8 <= end:
        a0 += row[i]
        a1 += row[i + 1]
        a2 += row[i + 2]
        a3 += row[i + 3]
        a4 += row[i + 4]
        a5 += row[i + 5]
        a6 += row[i + 6]
        a7 += row[i + 7]
        i += 8
    while i < end:
        a0 += row[i]
        i += 1
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _fallback_token(row):  # pragma: no cover - jitted
    # The first maximum with NaN ignored (NaN > x is False); 0 when nothing is above -inf.
    best = -np.inf
    chosen = 0
    for i in range(row.shape[0]):
        if row[i] > best:
            best = row[i]
            chosen = i
    return chosen


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _inverse_cdf_row(row, u):  # pragma: no cover - jitted
    """The first index whose cumulative probability exceeds u * total (the fallback token where the
    total is not a finite positive number)."""
    vocab = row.shape[0]
    num_blocks = (vocab + _CDF_BLOCK - 1) // _CDF_BLOCK
    sums = np.empty(num_blocks, np.float64)
    total = 0.0
    for b in range(num_blocks):
        sums[b] = _block_sum(row, b * _CDF_BLOCK, min(vocab, (b + 1) * _CDF_BLOCK))
        total += sums[b]
    if not (0.0 < total < np.inf):  # NaN, inf or no mass: no distribution (sampling_rules.py)
        return _fallback_token(row)
    target = u * total
    chosen = -1
    last_positive = -1
    before = 0.0
    for b in range(num_blocks):
        if before + sums[b] > target:
            running = before
            for i in range(b * _CDF_BLOCK, min(vocab, (b + 1) * _CDF_BLOCK)):
                if row[i] > 0:
                    last_positive = i
                    running += row[i]
                    if running > target:
                        chosen = i
                        break
            break
        before += sums[b]
    if chosen < 0:
        # Rounding put the target past the last running sum: take the last positive token
        # seen (or of the row); a 1e-16-probability event, never a zero-probability token.
        if last_positive < 0:
            for i in range(vocab - 1, -1, -1):
                if row[i] > 0:
                    last_positive = i
                    break
        chosen = max(last_positive, 0)
    return chosen


@numba.njit(parallel=True, cache=True, nogil=True, boundscheck=False)
def _inverse_cdf_kernel(probs, u, out):  # pragma: no cover - jitted
    for r in numba.prange(probs.shape[0]):
        out[r] = _inverse_cdf_row(probs[r], u[r])


def inverse_cdf_sample_cpu(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """int64 (B,): per row, the first token whose cumulative probability exceeds u * total (the
    fallback token where the total is not a finite positive number)."""
    probs32 = probs if probs.dtype == torch.float32 else probs.to(torch.float32)
    out = torch.empty(probs.shape[0], dtype=torch.int64)
    if probs.shape[0]:
        _inverse_cdf_kernel(probs32.contiguous().numpy(), u.to(torch.float64).contiguous().numpy(), out.numpy())
    return out


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _sift_down(heap, pos, size):  # pragma: no cover - jitted
    item = heap[pos]
    while True:
        child = 2 * pos + 1
        if child >= size:
            break
        if child + 1 < size and heap[child + 1] < heap[child]:
            child += 1
        if heap[child] < item:
            heap[pos] = heap[child]
            pos = child
        else:
            break
    heap[pos] = item


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _kth_largest_by_buckets(row, bits, k):  # pragma: no cover - jitted
    """The k-th largest of a row in two passes: count values per bucket of their 12 high ordered
    bits, then select within the one bucket that holds the k-th."""
    count = np.zeros(_NUM_BUCKETS, np.int64)
    for i in range(row.shape[0]):
        count[_ordered_bucket(bits[i])] += 1
    above = 0
    boundary = _NUM_BUCKETS - 1
    while above + count[boundary] < k:
        above += count[boundary]
        boundary -= 1
    members = np.empty(count[boundary], row.dtype)
    j = 0
    for i in range(row.shape[0]):
        if _ordered_bucket(bits[i]) == boundary:
            members[j] = row[i]
            j += 1
    rank = k - above  # the rank-th largest member
    return np.partition(members, members.shape[0] - rank)[members.shape[0] - rank]


@numba.njit(inline="always")
def _ordered_bucket(b):  # pragma: no cover - jitted
    # Flip the magnitude bits of negative floats so that integer order is float order, then take
    # the 12 high bits with the sign bit inverted: bucket order is value order.
    key = b ^ 0x7FFFFFFF if b < 0 else b
    return (key >> _KEY_SHIFT) + _NUM_BUCKETS // 2


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _kth_largest(row, bits, k):  # pragma: no cover - jitted
    if k > _HEAP_MAX_K:
        return _kth_largest_by_buckets(row, bits, k)
    heap = row[:k].copy()
    for pos in range(k // 2 - 1, -1, -1):
        _sift_down(heap, pos, k)
    smallest = heap[0]
    # A plain scan: the branch is almost never taken once the heap warmed up, so prediction makes
    # it cheaper than testing chunks first (measured).
    for i in range(k, row.shape[0]):
        x = row[i]
        if x > smallest:
            heap[0] = x
            _sift_down(heap, 0, k)
            smallest = heap[0]
    return smallest


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _top_k_row(row, bits, k):  # pragma: no cover - jitted
    # In place: keep the values >= the k-th largest (k <= 0 or >= the row's length keeps the row).
    vocab = row.shape[0]
    if k <= 0 or k >= vocab:
        return
    kth = _kth_largest(row, bits, k)
    for i in range(vocab):
        row[i] = -np.inf if row[i] < kth else row[i]  # branch-free, as in the top-p kernel


@numba.njit(parallel=True, cache=True, nogil=True, boundscheck=False)
def _top_k_kernel(logits, bits, k):  # pragma: no cover - jitted
    for r in numba.prange(logits.shape[0]):
        _top_k_row(logits[r], bits[r], k[r])


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _top_p_threshold(prow, brow, top_p, mass, members):  # pragma: no cover - jitted
    """The smallest probability top-p keeps (0.0: it keeps the row), from non-negative `prow`
    (brow: its int32 bits) on any scale, `top_p` on the same scale. mass (the histogram) is all
    zero on entry and left all zero; members: float32 scratch of at least len(prow)."""
    # A row clears the buckets it touched (not all 4096: on short rows, e.g. a tree's candidates,
    # clearing 32 KB per row cost more than the row itself). A bucket holds mass iff it holds a
    # value (only values > 0 are counted), so no count is kept: one scattered update per value.
    vocab = prow.shape[0]
    top = -1
    for i in range(vocab):
        if brow[i] <= 0:  # zero (or negative garbage): no mass; after top-k most tokens are here
            continue
        b = brow[i] >> _BUCKET_SHIFT
        mass[b] += prow[i]
        top = max(top, b)
    # The bucket where the mass accumulated from the top first reaches top_p holds the cut:
    # higher buckets are kept whole, lower ones removed whole.
    above = 0.0
    boundary = -1
    for b in range(top, -1, -1):
        if mass[b] == 0.0:
            continue
        if above + mass[b] >= top_p:
            boundary = b
            break
        above += mass[b]
    if vocab * 4 < _NUM_BUCKETS:
        for i in range(vocab):
            if brow[i] > 0:
                mass[brow[i] >> _BUCKET_SHIFT] = 0.0
    else:
        mass[: top + 1] = 0.0
    if boundary < 0:
        return np.float32(0.0)
    size = 0
    for i in range(vocab):
        if brow[i] > 0 and brow[i] >> _BUCKET_SHIFT == boundary:
            members[size] = prow[i]
            size += 1
    ordered = np.sort(members[:size])[::-1]
    threshold = ordered[0]
    i = 0
    while i < size and above < top_p:
        value = ordered[i]
        threshold = value
        while i < size and ordered[i] == value:  # a tie group shares its mass above
            above += ordered[i]
            i += 1
    return threshold


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _top_p_row(lrow, prow, brow, top_p, mass, members):  # pragma: no cover - jitted
    threshold = _top_p_threshold(prow, brow, top_p, mass, members)
    if threshold == 0.0:
        return
    for i in range(prow.shape[0]):
        # Branch-free selects: about 40% of a row goes, in no predictable order (a branch here
        # mispredicts and costs 2x the pass).
        drop = prow[i] < threshold
        lrow[i] = -np.inf if drop else lrow[i]
        prow[i] = 0.0 if drop else prow[i]


@numba.njit(parallel=True, cache=True, nogil=True, boundscheck=False)
def _top_p_kernel(logits, probs, bits, p, chunks):  # pragma: no cover - jitted
    rows, vocab = logits.shape
    for c in numba.prange(chunks):
        # One histogram and members scratch per chunk of rows, reused row after row.
        mass = np.zeros(_NUM_BUCKETS, np.float64)
        members = np.empty(vocab, np.float32)
        for r in range(c, rows, chunks):
            if p[r] < 1.0:
                _top_p_row(logits[r], probs[r], bits[r], p[r], mass, members)


def apply_top_k_cpu(logits: torch.Tensor, k: torch.Tensor) -> None:
    """In place on float32 (B, V): keep logits >= the row's k-th largest (rows with k <= 0 or >= V untouched)."""
    _top_k_kernel(logits.numpy(), logits.view(torch.int32).numpy(), k.to(torch.int64).contiguous().numpy())


def apply_top_p_cpu(logits: torch.Tensor, probs: torch.Tensor, p: torch.Tensor) -> None:
    """In place on float32 (B, V): remove tokens whose probability mass strictly above is >= p
    (`probs` = softmax(logits), float32, contiguous; their probs become 0 too)."""
    chunks = max(1, min(logits.shape[0], numba.get_num_threads()))  # one histogram per thread
    _top_p_kernel(logits.numpy(), probs.numpy(), probs.view(torch.int32).numpy(), p.to(torch.float64).contiguous().numpy(), chunks)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _row_argmax(row, bits):  # pragma: no cover - jitted
    # The maximum over order-preserving integer keys of the float bits (a loop LLVM vectorises,
    # unlike a float max that must respect NaN), then the first element equal to it. torch.argmax
    # semantics: the first maximum, -0.0 == 0.0, and a NaN counts as the maximum.
    best = np.int32(-2147483648)
    nan = False
    for i in range(row.shape[0]):
        b = bits[i]
        best = max(best, b ^ ((b >> 31) & 0x7FFFFFFF))
        nan |= (b & 0x7FFFFFFF) > 0x7F800000
    if nan:
        for i in range(row.shape[0]):
            if row[i] != row[i]:
                return i
    target = np.array([best ^ ((best >> 31) & 0x7FFFFFFF)], np.int32).view(np.float32)[0]
    for i in range(row.shape[0]):
        if row[i] == target:
            return i
    return 0


@numba.njit(parallel=True, cache=True, nogil=True, boundscheck=False)
def _argmax_kernel(logits, bits, out):  # pragma: no cover - jitted
    for r in numba.prange(logits.shape[0]):
        out[r] = _row_argmax(logits[r], bits[r])


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _argmax_serial(logits, bits, out):  # pragma: no cover - jitted
    for r in range(logits.shape[0]):
        out[r] = _row_argmax(logits[r], bits[r])


# Up to this many values a serial loop beats the parallel launch (small sparse layouts).
_ARGMAX_SERIAL_MAX = 1 << 16


def argmax_cpu(logits: torch.Tensor) -> torch.Tensor:
    """int64 (B,): torch.argmax(logits, -1) for float32 (B, V) logits with V >= 1, about twice as
    fast (torch's CPU argmax is a scalar loop)."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if logits.shape[0]:
        kernel = _argmax_serial if logits.numel() <= _ARGMAX_SERIAL_MAX else _argmax_kernel
        kernel(logits.numpy(), logits.view(torch.int32).numpy(), out.numpy())
    return out
