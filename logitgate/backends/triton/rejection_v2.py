"""Rejection-sampling kernels of the v2 CUDA variant (LOGITGATE_CUDA_KERNELS=rejection=v2).

The current kernels give each request one program that walks its rows serially (64 programs for a
batch of 64 on 132 SMs, each reading 512 KB per row tile by tile). Here every pass is a grid over
(row, vocabulary chunk), and per-request work reduces the chunks' partial results:

1. `_row_stats_kernel` (rows x chunks): per chunk of every row of logits / temperature, the NaN-free
   maximum and its first index, the first NaN, and the sum of exp(z - chunk max): one read of the
   logits gives each row's logsumexp, greedy argmax (torch's: a NaN wins) and fallback token.
2. `_accept_kernel` (requests): merges the chunks of a request's rows in order and applies the
   greedy test (draft == argmax) or the random one (target_p / draft_p >= u, target_p from the
   row's logsumexp and one logit), so greedy and random requests are verified in the same pass.
3. `_recover_partial_kernel` (requests x chunks): for each request whose random verification
   rejected a draft, the exponential races argmax(w / q) over the residual w = max(target - draft,
   0) and argmax(target / q) over the target (the fallback when the residual is empty), q generated
   in the kernel from the request's Philox seed (philox.py) for the one rejected row only.
4. `_recover_merge_kernel` (requests): the recovered token, and in the one-go path the output row
   (accepted drafts, the correction or the bonus, then -1).

Semantics are the reference's (reference/rejection.py); the temperature division is rounded as
torch's, acceptance ratios are float64, as in the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .philox import exponential_noise
from .sampling_v2 import INT32_MAX, _first_max

# Phase 1 record per (row, chunk): first NaN, NaN-free maximum (float bits), its first index, and
# sum(exp(z - maximum)) (float bits).
_S_NAN, _S_MAX, _S_ARGMAX, _S_SUM, _S_FIELDS = (tl.constexpr(i) for i in range(5))
# Phase 3 record per (request, chunk): best residual score and its token, best target score and its
# token (float bits / int), the residual's total, the NaN-free maximum of z and its first index.
_P_W, _P_W_TOKEN, _P_T, _P_T_TOKEN, _P_W_TOTAL, _P_MAX, _P_ARGMAX, _P_FIELDS = (tl.constexpr(i) for i in range(8))


@triton.jit
def _row_temperature(temperature_ptr, token_request_ptr, row, HAS_TEMPERATURE: tl.constexpr):
    """The temperature of `row` (its request's; 0 = a greedy request, whose row is left unscaled)."""
    t = tl.full((), 1.0, tl.float32)
    if HAS_TEMPERATURE:
        t = tl.load(temperature_ptr + tl.load(token_request_ptr + row)).to(tl.float32)
        t = tl.where(t == 0.0, 1.0, t)
    return t


@triton.jit
def _tempered_chunk(logits_ptr, logits_stride, row, offs, inside, t, HAS_TEMPERATURE: tl.constexpr):
    z = tl.load(logits_ptr + row.to(tl.int64) * logits_stride + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_TEMPERATURE:
        z = tl.math.div_rn(z, t)  # as torch divides (Triton's `/` is approximate)
    return z


@triton.jit
def _row_stats_kernel(
    logits_ptr, temperature_ptr, token_request_ptr, stats_ptr,
    vocab_size, logits_stride, num_chunks,
    HAS_TEMPERATURE: tl.constexpr, CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = offs < vocab_size
    t = _row_temperature(temperature_ptr, token_request_ptr, row, HAS_TEMPERATURE)
    z = _tempered_chunk(logits_ptr, logits_stride, row, offs, inside, t, HAS_TEMPERATURE)
    nan = inside & (z != z)
    clean = tl.where(nan | ~inside, -float("inf"), z)
    best, where = _first_max(clean, tl.where(inside, offs, INT32_MAX))
    pivot = tl.where((best > -float("inf")) & (best < float("inf")), best, 0.0)
    total = tl.sum(tl.exp(clean - pivot), axis=0)
    rec = stats_ptr + (row * num_chunks + chunk).to(tl.int64) * _S_FIELDS
    tl.store(rec + _S_NAN, tl.min(tl.where(nan, offs, INT32_MAX), axis=0))
    tl.store(rec + _S_MAX, best.to(tl.int32, bitcast=True))
    tl.store(rec + _S_ARGMAX, where)
    tl.store(rec + _S_SUM, total.to(tl.int32, bitcast=True))


@triton.jit
def _merged_row(stats_ptr, row, num_chunks, CHUNKS: tl.constexpr):
    """(logsumexp, greedy argmax (first NaN, else first maximum), fallback token (first NaN-free
    maximum)) of `row` from its chunks' records."""
    c = tl.arange(0, CHUNKS)
    ok = c < num_chunks
    rec = stats_ptr + (row * num_chunks + c).to(tl.int64) * _S_FIELDS
    first_nan = tl.min(tl.load(rec + _S_NAN, mask=ok, other=INT32_MAX), axis=0)
    cmax = tl.where(ok, tl.load(rec + _S_MAX, mask=ok, other=0).to(tl.float32, bitcast=True), -float("inf"))
    csum = tl.where(ok, tl.load(rec + _S_SUM, mask=ok, other=0).to(tl.float32, bitcast=True), 0.0)
    best, fallback = _first_max(cmax, tl.load(rec + _S_ARGMAX, mask=ok, other=INT32_MAX))
    finite = (best > -float("inf")) & (best < float("inf"))
    pivot = tl.where(finite, best, 0.0)
    lse = pivot + tl.log(tl.sum(tl.where(cmax > -float("inf"), csum * tl.exp(cmax - pivot), 0.0), axis=0))
    lse = tl.where(finite, lse, best)  # +inf, or -inf for a row of -inf
    lse = tl.where(first_nan < INT32_MAX, float("nan"), lse)
    greedy = tl.where(first_nan < INT32_MAX, first_nan, fallback)
    return lse, greedy, fallback


@triton.jit
def _accept_kernel(
    stats_ptr, cu_ptr, draft_ptr, logits_ptr, temperature_ptr, token_request_ptr, draft_probs_ptr, uniform_ptr,
    accepted_ptr, lse_ptr, correction_ptr, random_ptr,
    vocab_size, logits_stride, probs_stride, num_chunks,
    ALL_GREEDY: tl.constexpr, HAS_TEMPERATURE: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr, CHUNKS: tl.constexpr,
):
    r = tl.program_id(0)
    start = tl.load(cu_ptr + r - 1, mask=r > 0, other=0)
    end = tl.load(cu_ptr + r)
    if ALL_GREEDY:
        is_random = tl.full((), 0, tl.int32) != 0
    else:
        is_random = tl.full((), 1, tl.int32) != 0
    if HAS_TEMPERATURE:
        is_random = tl.load(temperature_ptr + r).to(tl.float32) != 0.0
    count = 0
    correction = 0
    row_lse = 0.0
    rejected = False
    for row in range(start, end):
        if not rejected:
            lse, greedy, fallback = _merged_row(stats_ptr, row, num_chunks, CHUNKS)
            x = tl.load(draft_ptr + row).to(tl.int64)
            if is_random:
                valid = (x >= 0) & (x < vocab_size)
                safe = tl.where(valid, x, 0)
                t = _row_temperature(temperature_ptr, token_request_ptr, row, HAS_TEMPERATURE)
                z = tl.load(logits_ptr + tl.cast(row, tl.int64) * logits_stride + safe).to(tl.float32)
                if HAS_TEMPERATURE:
                    z = tl.math.div_rn(z, t)
                target_p = tl.exp(z - lse).to(tl.float64)
                if (lse != lse) | (lse == float("inf")) | (lse == -float("inf")):
                    # No distribution: a point mass on the fallback token (sampling_rules.py).
                    target_p = tl.where(x == fallback, 1.0, 0.0).to(tl.float64)
                draft_p = tl.full((), 1.0, tl.float64)
                if HAS_DRAFT_PROBS:
                    draft_p = tl.load(draft_probs_ptr + tl.cast(row, tl.int64) * probs_stride + safe).to(tl.float64)
                u = tl.load(uniform_ptr + row)
                ok = valid & (draft_p > 0) & (target_p > 0) & (target_p / tl.where(draft_p > 0, draft_p, 1.0) >= u)
                if ok:
                    count += 1
                else:
                    rejected = True
                    row_lse = lse
                    correction = fallback  # used only when the row has no distribution
            else:
                if x == greedy:
                    count += 1
                else:
                    rejected = True
                    correction = greedy
    tl.store(accepted_ptr + r, count)
    tl.store(lse_ptr + r, row_lse)
    tl.store(correction_ptr + r, correction)
    tl.store(random_ptr + r, is_random.to(tl.int32))


@triton.jit
def _recover_partial_kernel(
    cu_ptr, draft_ptr, logits_ptr, temperature_ptr, token_request_ptr, draft_probs_ptr, accepted_ptr, lse_ptr,
    random_ptr, seed_ptr, part_ptr,
    vocab_size, logits_stride, probs_stride, num_chunks,
    HAS_TEMPERATURE: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr, HAS_RANDOM: tl.constexpr, CHUNK: tl.constexpr,
):
    r = tl.program_id(0)
    chunk = tl.program_id(1)
    start = tl.load(cu_ptr + r - 1, mask=r > 0, other=0)
    row = start + tl.load(accepted_ptr + r)
    needed = row < tl.load(cu_ptr + r)
    if HAS_RANDOM:
        needed = needed & (tl.load(random_ptr + r) != 0)
    if needed:
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        inside = offs < vocab_size
        t = _row_temperature(temperature_ptr, token_request_ptr, row, HAS_TEMPERATURE)
        z = _tempered_chunk(logits_ptr, logits_stride, row, offs, inside, t, HAS_TEMPERATURE)
        target = tl.exp(z - tl.load(lse_ptr + r))
        target = tl.where(inside & (target > 0), target, 0.0)  # NaN counts as 0
        x = tl.load(draft_ptr + row).to(tl.int64)
        if HAS_DRAFT_PROBS:
            d = tl.load(draft_probs_ptr + row.to(tl.int64) * probs_stride + offs, mask=inside, other=0.0).to(tl.float32)
            residual = target - d
        else:
            residual = tl.where(offs == x, 0.0, target)
        valid = (x >= 0) & (x < vocab_size)
        w = tl.where(valid, tl.where(residual > 0, residual, 0.0), target)
        q = exponential_noise(tl.load(seed_ptr + r), offs)
        best_w, token_w = _first_max(tl.where(w > 0, w / q, -1.0), offs)
        best_t, token_t = _first_max(tl.where(target > 0, target / q, -1.0), offs)
        clean = tl.where(inside & (z == z), z, -float("inf"))
        zmax, zidx = _first_max(clean, tl.where(inside, offs, INT32_MAX))
        rec = part_ptr + (r * num_chunks + chunk).to(tl.int64) * _P_FIELDS
        tl.store(rec + _P_W, best_w.to(tl.int32, bitcast=True))
        tl.store(rec + _P_W_TOKEN, token_w)
        tl.store(rec + _P_T, best_t.to(tl.int32, bitcast=True))
        tl.store(rec + _P_T_TOKEN, token_t)
        tl.store(rec + _P_W_TOTAL, tl.sum(w, axis=0).to(tl.int32, bitcast=True))
        tl.store(rec + _P_MAX, zmax.to(tl.int32, bitcast=True))
        tl.store(rec + _P_ARGMAX, zidx)


@triton.jit
def _recover_merge_kernel(
    cu_ptr, draft_ptr, bonus_ptr, accepted_ptr, lse_ptr, random_ptr, correction_ptr, part_ptr, out_ptr,
    num_chunks, vocab_size, out_stride,
    HAS_RANDOM: tl.constexpr, HAS_CORRECTION: tl.constexpr, WRITE_OUTPUT: tl.constexpr,
    CHUNKS: tl.constexpr, WIDTH: tl.constexpr,
):
    r = tl.program_id(0)
    start = tl.load(cu_ptr + r - 1, mask=r > 0, other=0)
    count = tl.load(cu_ptr + r) - start
    accepted = tl.load(accepted_ptr + r)
    needed = accepted < count
    if HAS_RANDOM:
        needed = needed & (tl.load(random_ptr + r) != 0)
    token = tl.full((), 0, tl.int32)
    if HAS_CORRECTION:
        token = tl.load(correction_ptr + r)
    if needed:
        c = tl.arange(0, CHUNKS)
        ok = c < num_chunks
        rec = part_ptr + (r * num_chunks + c).to(tl.int64) * _P_FIELDS
        none = tl.full((CHUNKS,), -1.0, tl.float32)
        best_w = tl.where(ok, tl.load(rec + _P_W, mask=ok, other=0).to(tl.float32, bitcast=True), none)
        best_t = tl.where(ok, tl.load(rec + _P_T, mask=ok, other=0).to(tl.float32, bitcast=True), none)
        w_total = tl.sum(tl.where(ok, tl.load(rec + _P_W_TOTAL, mask=ok, other=0).to(tl.float32, bitcast=True), 0.0), axis=0)
        _, token_w = _first_max(best_w, tl.load(rec + _P_W_TOKEN, mask=ok, other=INT32_MAX))
        _, token_t = _first_max(best_t, tl.load(rec + _P_T_TOKEN, mask=ok, other=INT32_MAX))
        zmax = tl.where(ok, tl.load(rec + _P_MAX, mask=ok, other=0).to(tl.float32, bitcast=True), -float("inf"))
        _, fallback = _first_max(zmax, tl.load(rec + _P_ARGMAX, mask=ok, other=INT32_MAX))
        token = tl.where(w_total > 0, token_w, token_t)
        token = tl.minimum(tl.maximum(token, 0), vocab_size - 1)
        lse = tl.load(lse_ptr + r)
        if (lse != lse) | (lse == float("inf")) | (lse == -float("inf")):
            token = fallback  # no distribution: a point mass on the fallback token
    if WRITE_OUTPUT:
        cols = tl.arange(0, WIDTH)
        final = tl.where(needed | (accepted < count), token, tl.load(bonus_ptr + r).to(tl.int32))
        drafted = tl.load(draft_ptr + start + cols, mask=cols < accepted, other=-1).to(tl.int32)
        row_out = tl.where(cols < accepted, drafted, tl.where(cols == accepted, final, -1))
        tl.store(out_ptr + r * out_stride + cols, row_out, mask=cols < out_stride)
    else:
        tl.store(out_ptr + r, tl.where(needed, token, 0))


# ---- launchers (2-D tensors with unit stride in the vocabulary; inputs validated by the caller) ----


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _chunks(vocab: int, chunk: int) -> tuple[int, int, int]:
    """(chunk, number of chunks, its power of two for the merges)."""
    chunk = min(chunk, max(16, triton.next_power_of_2(vocab)))
    num = triton.cdiv(vocab, chunk)
    return chunk, num, max(2, triton.next_power_of_2(num))


def _warps(chunk: int) -> int:
    return 8 if chunk >= 4096 else 4


def _inputs(draft_token_ids, target_logits, draft_probs, chunk: int):
    """(logits, draft probs, drafts, vocab, chunk, chunks, chunks' power of two) as the kernels read them."""
    logits, probs = _rows(target_logits), _rows(draft_probs)
    vocab = logits.shape[-1]
    return (logits, probs, draft_token_ids.contiguous(), vocab, *_chunks(vocab, chunk))


def _recover_partials(cu, drafts, logits, temp, token_request, probs, accepted, lse, random, seeds, *,
                      has_temperature: bool, has_random: bool, chunk: int, num_chunks: int) -> torch.Tensor:
    """Phase 3 over (request, chunk): the partial races of every request that recovers."""
    batch = cu.numel()
    part = torch.empty((batch, num_chunks, _P_FIELDS.value), dtype=torch.int32, device=logits.device)
    _recover_partial_kernel[(batch, num_chunks)](
        cu, drafts, logits, temp, token_request, probs if probs is not None else logits, accepted, lse, random, seeds,
        part, logits.shape[-1], logits.stride(0), probs.stride(0) if probs is not None else 0, num_chunks,
        HAS_TEMPERATURE=has_temperature, HAS_DRAFT_PROBS=probs is not None, HAS_RANDOM=has_random, CHUNK=chunk,
        num_warps=_warps(chunk),
    )
    return part


def verify_v2(
    cu, token_request, draft_token_ids, target_logits, temperature, draft_probs, uniform, seeds, bonus, width,
    *, all_greedy: bool, chunk: int,
):
    """(output int32 (B, width), accepted int32 (B,)): greedy and random verification, recovery and
    the output in four launches. temperature: per request (B,) float32, 0 = greedy (None: every
    request at temperature 1, or all greedy with all_greedy). Pointers a specialisation never
    reads are given the logits."""
    batch = cu.numel()
    dev = target_logits.device
    logits, probs, drafts, vocab, chunk, num_chunks, chunks_p2 = _inputs(draft_token_ids, target_logits, draft_probs, chunk)
    has_t = temperature is not None and not all_greedy
    temp = temperature.contiguous() if has_t else cu
    stats = torch.empty((logits.shape[0], num_chunks, _S_FIELDS.value), dtype=torch.int32, device=dev)
    _row_stats_kernel[(logits.shape[0], num_chunks)](
        logits, temp, token_request, stats, vocab, logits.stride(0), num_chunks,
        HAS_TEMPERATURE=has_t, CHUNK=chunk, num_warps=_warps(chunk),
    )
    req = torch.empty((4, batch), dtype=torch.int32, device=dev)
    accepted, correction, random = req[0], req[2], req[3]
    lse = req[1].view(torch.float32)
    _accept_kernel[(batch,)](
        stats, cu, drafts, logits, temp, token_request, probs if probs is not None else logits,
        uniform if uniform is not None else logits, accepted, lse, correction, random,
        vocab, logits.stride(0), probs.stride(0) if probs is not None else 0, num_chunks,
        ALL_GREEDY=all_greedy, HAS_TEMPERATURE=has_t, HAS_DRAFT_PROBS=probs is not None, CHUNKS=chunks_p2,
    )
    part = stats  # never read when every request is greedy
    if not all_greedy:
        part = _recover_partials(cu, drafts, logits, temp, token_request, probs, accepted, lse, random, seeds,
                                 has_temperature=has_t, has_random=True, chunk=chunk, num_chunks=num_chunks)
    out = torch.empty((batch, width), dtype=torch.int32, device=dev)
    _recover_merge_kernel[(batch,)](
        cu, drafts, bonus, accepted, lse, random, correction, part, out, num_chunks, vocab, width,
        HAS_RANDOM=True, HAS_CORRECTION=True, WRITE_OUTPUT=True, CHUNKS=chunks_p2,
        WIDTH=max(2, triton.next_power_of_2(width)),
    )
    return out, accepted


def recover_v2(
    cu, draft_token_ids, target_logits, temperature, draft_probs, accepted, row_lse, seeds, active, *, chunk: int
):
    """int32 (B,): `rejection_recover` with the noise of `seeds` (per request): temperature per
    row (N,) or None; 0 where nothing is recovered (inactive, or every draft accepted)."""
    batch = cu.numel()
    logits, probs, drafts, vocab, chunk, num_chunks, chunks_p2 = _inputs(draft_token_ids, target_logits, draft_probs, chunk)
    has_t = temperature is not None
    rows = torch.arange(logits.shape[0], device=logits.device) if has_t else cu  # row i's temperature is temperature[i]
    temp = temperature.contiguous() if has_t else cu
    random = active.to(torch.int32) if active is not None else cu
    accepted = accepted.to(torch.int32).contiguous()
    row_lse = row_lse.to(torch.float32).contiguous()
    part = _recover_partials(cu, drafts, logits, temp, rows, probs, accepted, row_lse, random, seeds,
                             has_temperature=has_t, has_random=active is not None, chunk=chunk, num_chunks=num_chunks)
    out = torch.empty(batch, dtype=torch.int32, device=logits.device)
    _recover_merge_kernel[(batch,)](
        cu, drafts, cu, accepted, row_lse, random, cu, part, out, num_chunks, vocab, 1,
        HAS_RANDOM=active is not None, HAS_CORRECTION=False, WRITE_OUTPUT=False, CHUNKS=chunks_p2, WIDTH=2,
    )
    return out
