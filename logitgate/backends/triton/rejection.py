"""Triton kernels for rejection sampling, shared by CUDA and Ascend (triton-ascend).

Each program verifies REQUESTS_PER_PROGRAM requests (1 on CUDA, one program per request; on
Ascend grid = min(B, vector cores) and a power-of-two block of requests each, vllm-ascend's
cal_grid_and_block_size). Within a request the drafts are checked in order and a row is read only
while nothing has been rejected, in vocabulary tiles of BLOCK_V tokens (sized on Ascend for the
192 KB unified buffer). Nothing is written per token: the acceptance test needs one logsumexp per
row and the recovered token one pass over the single rejected row (the exponential race). All
arithmetic is float32 (the interpreter cannot do bfloat16). Semantics: ../reference/rejection.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _request(cu_ptr, active_ptr, pid, i, batch_size, HAS_ACTIVE: tl.constexpr, REQUESTS_PER_PROGRAM: tl.constexpr):
    """The i-th request of this program: (index, exists, its rows [start, end)); an inactive
    request has no rows."""
    r = pid * REQUESTS_PER_PROGRAM + i
    exists = r < batch_size
    safe = tl.where(exists, r, 0)
    start = tl.load(cu_ptr + safe - 1, mask=safe > 0, other=0)
    end = tl.load(cu_ptr + safe)
    if HAS_ACTIVE:
        end = tl.where(tl.load(active_ptr + safe) != 0, end, start)
    return r, exists, start, end


@triton.jit
def _row_argmax(row_ptr, vocab_size, temperature, BLOCK_V: tl.constexpr, NAN_IS_MAX: tl.constexpr):
    """The first maximum of row / temperature; with NAN_IS_MAX torch.argmax semantics (the first
    NaN if any), else NaN ignored (sampling_rules.fallback_tokens: 0 when nothing is above -inf).
    Always < vocab_size."""
    best_val = -float("inf")
    best_idx = 0
    first_nan = vocab_size
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=-float("inf")).to(tl.float32) / temperature
        is_nan = x != x
        first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan, offs, vocab_size), axis=0))
        x = tl.where(is_nan, -float("inf"), x)
        tile_max = tl.max(x, axis=0)
        tile_idx = tl.min(tl.where(x == tile_max, offs, vocab_size), axis=0)
        better = tile_max > best_val
        best_idx = tl.where(better, tile_idx, best_idx)
        best_val = tl.where(better, tile_max, best_val)
    if NAN_IS_MAX:
        best_idx = tl.where(first_nan < vocab_size, first_nan, best_idx)
    return best_idx


@triton.jit
def _row_lse(row_ptr, vocab_size, temperature, BLOCK_V: tl.constexpr):
    """Online logsumexp of row / temperature (one read): -inf for an all -inf row, NaN with NaNs."""
    m = -float("inf")
    s = 0.0
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        z = tl.load(row_ptr + offs, mask=offs < vocab_size, other=-float("inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(z, axis=0))
        pivot = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - pivot) + tl.sum(tl.exp(z - pivot), axis=0)
        m = m_new
    return tl.where(m == -float("inf"), -float("inf"), m + tl.log(s))


@triton.jit
def _greedy_accept_kernel(
    cu_ptr, draft_ptr, logits_ptr, active_ptr, accepted_ptr, correction_ptr,
    batch_size, vocab_size, logits_stride,
    HAS_ACTIVE: tl.constexpr, REQUESTS_PER_PROGRAM: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    for i in range(REQUESTS_PER_PROGRAM):
        r, exists, start, end = _request(cu_ptr, active_ptr, pid, i, batch_size, HAS_ACTIVE, REQUESTS_PER_PROGRAM)
        if exists:
            count = 0
            correction = 0
            rejected = False
            for row in range(start, end):
                if not rejected:
                    best = _row_argmax(logits_ptr + tl.cast(row, tl.int64) * logits_stride, vocab_size, 1.0, BLOCK_V, True)
                    if tl.load(draft_ptr + row).to(tl.int64) != best:
                        rejected = True
                        correction = best
                    else:
                        count += 1
            tl.store(accepted_ptr + r, count)
            tl.store(correction_ptr + r, correction)


@triton.jit
def _random_accept_kernel(
    cu_ptr, draft_ptr, logits_ptr, temperature_ptr, draft_probs_ptr, uniform_ptr, active_ptr,
    accepted_ptr, row_lse_ptr,
    batch_size, vocab_size, logits_stride, probs_stride,
    HAS_TEMPERATURE: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr, HAS_ACTIVE: tl.constexpr,
    REQUESTS_PER_PROGRAM: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    for i in range(REQUESTS_PER_PROGRAM):
        r, exists, start, end = _request(cu_ptr, active_ptr, pid, i, batch_size, HAS_ACTIVE, REQUESTS_PER_PROGRAM)
        if exists:
            count = 0
            row_lse = 0.0
            rejected = False
            for row in range(start, end):
                if not rejected:
                    row64 = tl.cast(row, tl.int64)
                    temperature = 1.0
                    if HAS_TEMPERATURE:
                        temperature = tl.load(temperature_ptr + row).to(tl.float32)
                    lse = _row_lse(logits_ptr + row64 * logits_stride, vocab_size, temperature, BLOCK_V)
                    x = tl.load(draft_ptr + row).to(tl.int64)
                    valid = (x >= 0) & (x < vocab_size)
                    safe = tl.where(valid, x, 0)
                    z = tl.load(logits_ptr + row64 * logits_stride + safe).to(tl.float32) / temperature
                    target_p = tl.exp(z - lse)
                    if (lse != lse) | (lse == float("inf")) | (lse == -float("inf")):
                        # No distribution: a point mass on the fallback token (sampling_rules.py).
                        fallback = _row_argmax(logits_ptr + row64 * logits_stride, vocab_size, temperature, BLOCK_V, False)
                        target_p = tl.where(x == fallback, 1.0, 0.0)
                    draft_p = 1.0
                    if HAS_DRAFT_PROBS:
                        draft_p = tl.load(draft_probs_ptr + row64 * probs_stride + safe).to(tl.float32)
                    u = tl.load(uniform_ptr + row)
                    ratio = target_p.to(tl.float64) / tl.where(draft_p > 0, draft_p, 1.0)
                    ok = valid & (draft_p > 0) & (target_p > 0) & (ratio >= u)
                    if ok:
                        count += 1
                    else:
                        rejected = True
                        row_lse = lse
            tl.store(accepted_ptr + r, count)
            tl.store(row_lse_ptr + r, row_lse)


@triton.jit
def _recover_kernel(
    cu_ptr, draft_ptr, logits_ptr, temperature_ptr, draft_probs_ptr, accepted_ptr, row_lse_ptr, noise_ptr,
    active_ptr, out_ptr,
    batch_size, vocab_size, logits_stride, probs_stride, noise_stride,
    HAS_TEMPERATURE: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr, HAS_ACTIVE: tl.constexpr,
    REQUESTS_PER_PROGRAM: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """The exponential race argmax(w / q) over the rejected row's residual w, with the race over
    the target run alongside in the same pass as the fallback for an empty residual."""
    pid = tl.program_id(0)
    for i in range(REQUESTS_PER_PROGRAM):
        r, exists, start, end = _request(cu_ptr, active_ptr, pid, i, batch_size, HAS_ACTIVE, REQUESTS_PER_PROGRAM)
        if exists:
            row = start + tl.load(accepted_ptr + r)
            token = 0
            if row < end:
                row64 = tl.cast(row, tl.int64)
                temperature = 1.0
                if HAS_TEMPERATURE:
                    temperature = tl.load(temperature_ptr + row).to(tl.float32)
                lse = tl.load(row_lse_ptr + r)
                x = tl.load(draft_ptr + row).to(tl.int64)
                valid = (x >= 0) & (x < vocab_size)
                best_w = -1.0
                best_w_idx = 0
                best_t = -1.0
                best_t_idx = 0
                w_total = 0.0
                for tile in range(0, vocab_size, BLOCK_V):
                    offs = tile + tl.arange(0, BLOCK_V)
                    inside = offs < vocab_size
                    z = tl.load(logits_ptr + row64 * logits_stride + offs, mask=inside, other=-float("inf")).to(tl.float32)
                    t = tl.exp(z / temperature - lse)
                    t = tl.where(t > 0, t, 0.0)
                    if HAS_DRAFT_PROBS:
                        d = tl.load(draft_probs_ptr + row64 * probs_stride + offs, mask=inside, other=0.0).to(tl.float32)
                        w = t - d
                    else:
                        w = tl.where(offs == x, 0.0, t)
                    w = tl.where(valid, tl.where(w > 0, w, 0.0), t)
                    q = tl.load(noise_ptr + tl.cast(r, tl.int64) * noise_stride + offs, mask=inside, other=1.0)
                    score_w = tl.where(w > 0, w / q, -1.0)
                    score_t = tl.where(t > 0, t / q, -1.0)
                    tile_w = tl.max(score_w, axis=0)
                    tile_t = tl.max(score_t, axis=0)
                    idx_w = tl.min(tl.where(score_w == tile_w, offs, vocab_size), axis=0)
                    idx_t = tl.min(tl.where(score_t == tile_t, offs, vocab_size), axis=0)
                    best_w_idx = tl.where(tile_w > best_w, idx_w, best_w_idx)
                    best_w = tl.maximum(best_w, tile_w)
                    best_t_idx = tl.where(tile_t > best_t, idx_t, best_t_idx)
                    best_t = tl.maximum(best_t, tile_t)
                    w_total += tl.sum(w, axis=0)
                token = tl.where(w_total > 0, best_w_idx, best_t_idx)
                token = tl.minimum(tl.maximum(token, 0), vocab_size - 1)
                if (lse != lse) | (lse == float("inf")) | (lse == -float("inf")):
                    # No distribution: a point mass on the fallback token (sampling_rules.py).
                    token = _row_argmax(logits_ptr + row64 * logits_stride, vocab_size, temperature, BLOCK_V, False)
            tl.store(out_ptr + r, token)


# ---- launchers (2-D tensors with unit stride in the vocabulary; inputs validated by the caller) ----


def _dummy(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(1, dtype=torch.float32, device=like.device)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _tile(block_v: int, vocab_size: int) -> int:
    """No wider than the vocabulary (rounded up to a power of two): wider tiles only add masked lanes."""
    return max(16, min(block_v, triton.next_power_of_2(vocab_size)))


def greedy_accept_triton(cu, draft_token_ids, target_logits, active, *, grid: int, requests_per_program: int, block_v: int):
    batch = cu.numel()
    accepted = torch.zeros(batch, dtype=torch.int32, device=cu.device)
    correction = torch.zeros(batch, dtype=torch.int32, device=cu.device)
    if batch == 0:
        return accepted, correction
    logits = _rows(target_logits)
    _greedy_accept_kernel[(grid,)](
        cu, draft_token_ids.contiguous(), logits, active if active is not None else cu, accepted, correction,
        batch, logits.shape[-1], logits.stride(0),
        HAS_ACTIVE=active is not None, REQUESTS_PER_PROGRAM=requests_per_program, BLOCK_V=_tile(block_v, logits.shape[-1]),
    )
    return accepted, correction


def random_accept_triton(
    cu, draft_token_ids, target_logits, temperature, draft_probs, uniform, active, *, grid: int, requests_per_program: int, block_v: int
):
    batch = cu.numel()
    accepted = torch.zeros(batch, dtype=torch.int32, device=cu.device)
    row_lse = torch.zeros(batch, dtype=torch.float32, device=cu.device)
    if batch == 0:
        return accepted, row_lse
    logits = _rows(target_logits)
    probs = _rows(draft_probs) if draft_probs is not None else None
    _random_accept_kernel[(grid,)](
        cu, draft_token_ids.contiguous(), logits,
        temperature.contiguous() if temperature is not None else _dummy(cu),
        probs if probs is not None else _dummy(cu),
        uniform.contiguous(), active if active is not None else cu, accepted, row_lse,
        batch, logits.shape[-1], logits.stride(0), probs.stride(0) if probs is not None else 0,
        HAS_TEMPERATURE=temperature is not None, HAS_DRAFT_PROBS=probs is not None, HAS_ACTIVE=active is not None,
        REQUESTS_PER_PROGRAM=requests_per_program, BLOCK_V=_tile(block_v, logits.shape[-1]),
    )
    return accepted, row_lse


def recover_triton(
    cu, draft_token_ids, target_logits, temperature, draft_probs, accepted, row_lse, noise, active, *,
    grid: int, requests_per_program: int, block_v: int,
):
    batch = cu.numel()
    out = torch.zeros(batch, dtype=torch.int32, device=cu.device)
    if batch == 0:
        return out
    logits = _rows(target_logits)
    probs = _rows(draft_probs) if draft_probs is not None else None
    noise = _rows(noise)
    _recover_kernel[(grid,)](
        cu, draft_token_ids.contiguous(), logits,
        temperature.contiguous() if temperature is not None else _dummy(cu),
        probs if probs is not None else _dummy(cu),
        accepted.contiguous(), row_lse.contiguous(), noise, active if active is not None else cu, out,
        batch, logits.shape[-1], logits.stride(0), probs.stride(0) if probs is not None else 0, noise.stride(0),
        HAS_TEMPERATURE=temperature is not None, HAS_DRAFT_PROBS=probs is not None, HAS_ACTIVE=active is not None,
        REQUESTS_PER_PROGRAM=requests_per_program, BLOCK_V=_tile(block_v, logits.shape[-1]),
    )
    return out
