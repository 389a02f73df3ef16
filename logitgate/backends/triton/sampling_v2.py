"""Sampling kernels of the v2 CUDA variant (LOGITGATE_CUDA_KERNELS=sampling=v2).

Both draws are exponential races argmax(p / q) whose noise q is generated in the kernel from one
Philox seed per row (philox.py): no (B, V) noise tensor is written or read. Both run over a
(row, vocabulary chunk) grid, so a decode batch of 64 rows fills the GPU, and finish with one
program per row that merges the chunks' partial results (a two-phase reduction, no atomics).

- `random_sample_v2`: the draw from probabilities (B, V), with the rows that have no total (a NaN,
  an inf, all 0) given their fallback token in the same pass (sampling_rules.py).
- `top_k_top_p_sample_v2`: top-k, then top-p, then the draw, from logits (optionally divided by a
  per-row temperature on load), for batches whose every row has 1 <= k <= K with K known on the
  host. Phase 1 reads each chunk once and writes its K largest logits (ties at the K-th value in
  index order, the number of tied ones left out recorded) and the chunk's NaN-free maximum; phase 2
  finds each row's exact k-th value over those candidates by bisection over the float bits (the
  left-out ties counted), the top-p cut by bisection over the bits of the renormalised
  probabilities, and draws among the survivors. Every logit >= the row's k-th value is a candidate
  of its chunk, so the support is complete, except when the k-th value's tie group has members left
  out and survives top-p: that row (rare: exact ties at the cut) is re-read whole by its phase-2
  program, with the same arithmetic, so the result is the same either way.

Semantics are the reference's (reference/sampling.py, sampling_rules.py); probabilities are float32
exp(x - max) / sum as torch's softmax, the top-p masses are summed in float64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .philox import exponential_noise
from .sampling import _ordered_key

INT32_MAX = tl.constexpr(2147483647)
# Per-chunk record of phase 1 of the top-k sampler, after the candidates' SLOTS values and SLOTS
# token ids: candidates written, the chunk's K-th value, its ties left out, NaN-free maximum, first
# index of that maximum, whether the chunk holds a NaN.
_N_WRITTEN, _KTH, _LEFT_OUT, _MAX, _ARGMAX, _NAN, _STATS = (tl.constexpr(i) for i in range(7))
# Partials of random_sample_v2 per (row, chunk): best race score, its token, the chunk's total,
# NaN-free maximum, its first index (the score and the maxima as float bits).
_R_SCORE, _R_TOKEN, _R_TOTAL, _R_MAX, _R_ARGMAX, _R_FIELDS = (tl.constexpr(i) for i in range(6))


@triton.jit
def _first_max(values, offs):
    """(max of values, first of offs where it is attained) over a block; values hold no NaN."""
    best = tl.max(values, axis=0)
    return best, tl.min(tl.where(values == best, offs, INT32_MAX), axis=0)


@triton.jit
def _first_max_2d(values, offs):
    """_first_max over both axes of a 2-D block."""
    best = tl.max(tl.max(values, axis=1), axis=0)
    return best, tl.min(tl.min(tl.where(values == best, offs, INT32_MAX), axis=1), axis=0)


@triton.jit
def _clean_max(values, offs, inside):
    """The NaN-free maximum of the lanes inside, its first index, and whether a NaN was seen."""
    nan = values != values
    clean = tl.where(nan | ~inside, -float("inf"), values)
    best, where = _first_max(tl.where(inside, clean, -float("inf")), tl.where(inside, offs, INT32_MAX))
    return clean, best, where, tl.max((nan & inside).to(tl.int32), axis=0)


# ---- random_sample ------------------------------------------------------------------------------


@triton.jit
def _race_partial_kernel(probs_ptr, seed_ptr, part_ptr, vocab_size, probs_stride, num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = offs < vocab_size
    p = tl.load(probs_ptr + row.to(tl.int64) * probs_stride + offs, mask=inside, other=0.0).to(tl.float32)
    q = exponential_noise(tl.load(seed_ptr + row), offs)
    # A NaN score only occurs in rows without a total, which take the fallback token instead.
    score = p / q
    best, token = _first_max(tl.where(inside & (score == score), score, -1.0), offs)
    _, fmax, fidx, _ = _clean_max(p, offs, inside)
    out = part_ptr + (row * num_chunks + chunk) * _R_FIELDS
    tl.store(out + _R_SCORE, best.to(tl.int32, bitcast=True))
    tl.store(out + _R_TOKEN, token)
    tl.store(out + _R_TOTAL, tl.sum(p, axis=0).to(tl.int32, bitcast=True))
    tl.store(out + _R_MAX, fmax.to(tl.int32, bitcast=True))
    tl.store(out + _R_ARGMAX, fidx)


@triton.jit
def _race_merge_kernel(part_ptr, out_ptr, num_chunks, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS)
    ok = c < num_chunks
    rec = part_ptr + (row * num_chunks + c) * _R_FIELDS
    score = tl.load(rec + _R_SCORE, mask=ok, other=0).to(tl.float32, bitcast=True)
    score = tl.where(ok, score, -1.0)
    token = tl.load(rec + _R_TOKEN, mask=ok, other=INT32_MAX)
    total = tl.sum(tl.where(ok, tl.load(rec + _R_TOTAL, mask=ok, other=0).to(tl.float32, bitcast=True), 0.0), axis=0)
    fmax = tl.where(ok, tl.load(rec + _R_MAX, mask=ok, other=0).to(tl.float32, bitcast=True), -float("inf"))
    fidx = tl.load(rec + _R_ARGMAX, mask=ok, other=INT32_MAX)
    _, won = _first_max(score, token)
    _, fallback = _first_max(fmax, fidx)
    defined = (total == total) & (total > 0) & (total < float("inf"))
    tl.store(out_ptr + row, tl.where(defined, won, fallback).to(tl.int64))


def random_sample_v2(probs: torch.Tensor, seeds: torch.Tensor, *, chunk: int = 8192) -> torch.Tensor:
    """int64 (B,): argmax(probs / q) per row with q from `seeds` (philox.py), the fallback token
    (argmax with NaN ignored) for rows whose float32 total is not a finite positive number."""
    rows, vocab = probs.shape
    if probs.stride(-1) != 1:
        probs = probs.contiguous()
    chunk = min(chunk, max(16, triton.next_power_of_2(vocab)))
    num_chunks = triton.cdiv(vocab, chunk)
    part = torch.empty((rows, num_chunks, _R_FIELDS.value), dtype=torch.int32, device=probs.device)
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    _race_partial_kernel[(rows, num_chunks)](probs, seeds, part, vocab, probs.stride(0), num_chunks, CHUNK=chunk,
                                             num_warps=8 if chunk >= 4096 else 4)
    _race_merge_kernel[(rows,)](part, out, num_chunks, CHUNKS=max(2, triton.next_power_of_2(num_chunks)))
    return out


# ---- top-k, top-p and the draw from logits ------------------------------------------------------


@triton.jit
def _tempered(x, temperature_ptr, row, HAS_TEMPERATURE: tl.constexpr):
    """x / the row's temperature, rounded as torch divides (ops.apply_temperature): Triton's `/`
    is the approximate division."""
    if HAS_TEMPERATURE:
        x = tl.math.div_rn(x, tl.load(temperature_ptr + row).to(tl.float32))
    return x


@triton.jit
def _chunk_candidates_kernel(
    logits_ptr, temperature_ptr, work_ptr,
    vocab_size, logits_stride, num_chunks, top,
    HAS_TEMPERATURE: tl.constexpr, CHUNK: tl.constexpr, SLOTS: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = offs < vocab_size
    x = tl.load(logits_ptr + row.to(tl.int64) * logits_stride + offs, mask=inside, other=0.0).to(tl.float32)
    x = _tempered(x, temperature_ptr, row, HAS_TEMPERATURE)
    clean, cmax, cidx, has_nan = _clean_max(x, offs, inside)  # a NaN counts as -inf here
    clean = tl.where(clean == 0.0, 0.0, clean)  # -0.0 == 0.0, but its bits would order below
    key = _ordered_key(clean.to(tl.int32, bitcast=True))
    # The chunk's `want`-th largest key (want = min(top, lanes inside)): the largest t with
    # count(key >= t) >= want, by bisection over the 2^32 keys.
    want = tl.minimum(top, tl.minimum(vocab_size - chunk * CHUNK, CHUNK))
    lo = tl.full((), -2147483648, tl.int64)
    hi = tl.full((), 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        count = tl.sum(((key >= mid.to(tl.int32)) & inside).to(tl.int32), axis=0)
        take = count >= want
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid - 1)
    kth = lo.to(tl.int32)
    above = inside & (key > kth)
    tied = inside & (key == kth)
    room = want - tl.sum(above.to(tl.int32), axis=0)
    num_tied = tl.sum(tied.to(tl.int32), axis=0)
    chosen = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= room))
    slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    rec = work_ptr + (row * num_chunks + chunk).to(tl.int64) * (2 * SLOTS + _STATS)
    tl.store(rec + slot, clean.to(tl.int32, bitcast=True), mask=chosen)
    tl.store(rec + SLOTS + slot, offs, mask=chosen)
    written = want - room + tl.minimum(num_tied, room)
    stats = rec + 2 * SLOTS
    tl.store(stats + _N_WRITTEN, written)
    tl.store(stats + _KTH, _ordered_key(kth))  # back to float bits
    tl.store(stats + _LEFT_OUT, num_tied - tl.minimum(num_tied, room))
    tl.store(stats + _MAX, cmax.to(tl.int32, bitcast=True))
    tl.store(stats + _ARGMAX, cidx)
    tl.store(stats + _NAN, has_nan)


@triton.jit
def _top_p_cut(probs, tie_prob, tie_count, top_p):
    """Smallest probability top-p keeps (as float bits): the smallest t with mass(p > t) < top_p,
    the mass summed in float64 over `probs` plus `tie_count` more tokens of probability tie_prob
    (left-out ties); 31 halvings of [0, +inf bits]. top_p <= 0 acts as the smallest positive value."""
    top_p = tl.maximum(top_p, 1e-30).to(tl.float64)
    bits = probs.to(tl.int32, bitcast=True)
    tie_bits = tie_prob.to(tl.int32, bitcast=True)
    lo = tl.full((), 0, tl.int32)
    hi = tl.full((), 0x7F800000, tl.int32)
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        mass = tl.sum(tl.sum(tl.where(bits > mid, probs, 0.0).to(tl.float64), axis=1), axis=0)
        mass += tl.where(tie_bits > mid, tie_count.to(tl.float64) * tie_prob.to(tl.float64), 0.0)
        below = mass < top_p
        hi = tl.where(below, mid, hi)
        lo = tl.where(below, lo, mid + 1)
    return hi


@triton.jit
def _merge_sample_kernel(
    work_ptr, logits_ptr, temperature_ptr, k_ptr, p_ptr, seed_ptr, out_ptr,
    vocab_size, logits_stride, num_chunks, top,
    HAS_TEMPERATURE: tl.constexpr, HAS_P: tl.constexpr,
    CHUNKS: tl.constexpr, SLOTS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS)
    s = tl.arange(0, SLOTS)
    ok = c < num_chunks
    rec = work_ptr + (row * num_chunks + c).to(tl.int64) * (2 * SLOTS + _STATS)
    stats = rec + 2 * SLOTS
    written = tl.load(stats + _N_WRITTEN, mask=ok, other=0)
    kth = tl.load(stats + _KTH, mask=ok, other=0).to(tl.float32, bitcast=True)
    left_out = tl.load(stats + _LEFT_OUT, mask=ok, other=0)
    cmax = tl.where(ok, tl.load(stats + _MAX, mask=ok, other=0).to(tl.float32, bitcast=True), -float("inf"))
    cidx = tl.load(stats + _ARGMAX, mask=ok, other=INT32_MAX)
    any_nan = tl.max(tl.load(stats + _NAN, mask=ok, other=0), axis=0)
    row_max, fallback = _first_max(cmax, cidx)
    defined = (any_nan == 0) & (row_max > -float("inf")) & (row_max < float("inf"))

    valid = ok[:, None] & (s[None, :] < written[:, None])
    x = tl.load(rec[:, None] + s[None, :], mask=valid, other=0).to(tl.float32, bitcast=True)
    x = tl.where(valid, x, -float("inf"))
    tok = tl.load(rec[:, None] + SLOTS + s[None, :], mask=valid, other=INT32_MAX)
    key = _ordered_key(x.to(tl.int32, bitcast=True))
    kth_key = _ordered_key(kth.to(tl.int32, bitcast=True))

    # Top-k: the row's k-th largest key, counting each chunk's left-out ties at its K-th value.
    k = tl.minimum(tl.maximum(tl.load(k_ptr + row).to(tl.int32), 1), top)
    lo = tl.full((), -2147483648, tl.int64)
    hi = tl.full((), 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        pivot = mid.to(tl.int32)
        count = tl.sum(tl.sum((valid & (key >= pivot)).to(tl.int32), axis=1), axis=0)
        count += tl.sum(tl.where(ok & (kth_key >= pivot), left_out, 0), axis=0)
        take = count >= k
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid - 1)
    cut_key = lo.to(tl.int32)
    cut = _ordered_key(cut_key).to(tl.float32, bitcast=True)
    kept = valid & (key >= cut_key)
    # Left-out ties sit at their chunk's K-th value, which is <= the cut: only those at the cut count.
    ties_out = tl.sum(tl.where(ok & (kth == cut), left_out, 0), axis=0)

    # Softmax of what top-k kept (float32, as torch's), then the top-p cut over its bits.
    e = tl.where(kept, tl.exp(x - row_max), 0.0)
    tie_e = tl.exp(cut - row_max)
    total = tl.sum(tl.sum(e, axis=1), axis=0) + ties_out.to(tl.float32) * tie_e
    probs = e / total
    tie_prob = tie_e / total
    floor = tl.full((), 0.0, tl.float32)
    if HAS_P:
        top_p = tl.load(p_ptr + row).to(tl.float32)
        if top_p < 1.0:  # NaN: False, the row keeps everything (as the reference)
            floor = _top_p_cut(probs, tie_prob, ties_out, top_p).to(tl.float32, bitcast=True)
    keep = kept & (probs >= floor)

    seed = tl.load(seed_ptr + row)
    q = exponential_noise(seed, tok)
    score = tl.where(keep, probs / q, -1.0)
    best, token = _first_max_2d(score, tok)
    if (ties_out > 0) & (tie_prob >= floor) & (tie_prob > 0.0) & defined:
        # Ties at the cut were left out of the candidates and survive: race over the whole row.
        best = tl.full((), -1.0, tl.float32)
        token = tl.full((), 0, tl.int32)
        for start in range(0, vocab_size, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            inside = offs < vocab_size
            v = tl.load(logits_ptr + row.to(tl.int64) * logits_stride + offs, mask=inside, other=0.0).to(tl.float32)
            v = _tempered(v, temperature_ptr, row, HAS_TEMPERATURE)
            v = tl.where(v == 0.0, 0.0, v)  # as phase 1: -0.0 keyed as 0.0
            pv = tl.exp(v - row_max) / total
            ok_v = inside & (v == v) & (_ordered_key(v.to(tl.int32, bitcast=True)) >= cut_key) & (pv >= floor)
            tile_best, tile_token = _first_max(tl.where(ok_v, pv / exponential_noise(seed, offs), -1.0), offs)
            token = tl.where(tile_best > best, tile_token, token)
            best = tl.maximum(best, tile_best)
    tl.store(out_ptr + row, tl.where(defined, token, fallback).to(tl.int64))


def top_k_top_p_sample_v2(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    k: torch.Tensor,
    p: torch.Tensor | None,
    max_top_k: int,
    seeds: torch.Tensor,
    *,
    chunk: int = 8192,
    block_v: int = 4096,
) -> torch.Tensor:
    """int64 (B,): one draw per row from softmax(top-p(top-k(logits / temperature))), rows without
    a distribution given their fallback token; every k in [1, max_top_k] (max_top_k < V); the
    temperature (None: the logits are tempered) is used as it is (the caller maps greedy rows to 1)."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunk = min(chunk, max(16, triton.next_power_of_2(vocab)))
    num_chunks = triton.cdiv(vocab, chunk)
    slots = max(2, triton.next_power_of_2(max_top_k))
    work = torch.empty((rows, num_chunks, 2 * slots + _STATS.value), dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    temp = temperature if temperature is not None else seeds  # unused without HAS_TEMPERATURE
    _chunk_candidates_kernel[(rows, num_chunks)](
        logits, temp, work, vocab, logits.stride(0), num_chunks, max_top_k,
        HAS_TEMPERATURE=temperature is not None, CHUNK=chunk, SLOTS=slots, num_warps=8 if chunk >= 4096 else 4,
    )
    _merge_sample_kernel[(rows,)](
        work, logits, temp, k, p if p is not None else temp, seeds, out,
        vocab, logits.stride(0), num_chunks, max_top_k,
        HAS_TEMPERATURE=temperature is not None, HAS_P=p is not None,
        CHUNKS=max(2, triton.next_power_of_2(num_chunks)), SLOTS=slots,
        BLOCK_V=min(block_v, max(16, triton.next_power_of_2(vocab))), num_warps=8,
    )
    return out
