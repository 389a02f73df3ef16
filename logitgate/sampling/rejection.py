"""Rejection sampling for speculative decoding: vLLM's rejection sampler, case for case.

Layout (vLLM's): the drafts of B requests are flattened into N = sum(num_draft_tokens) rows of
`draft_token_ids` / `target_logits` / `draft_probs`; the output is int32 (B, max_spec_len + 1):
the accepted drafts, then the correction at the first rejection (greedy: the target argmax;
random: the recovered token) or the bonus token when every draft was accepted, then -1.

The device work runs through `backend.rejection_*` (numba on CPU, Triton on CUDA/Ascend, the torch
reference elsewhere); this module validates inputs, draws the random numbers from the requests'
generators, and assembles the output. Nothing here waits for the device.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..backends import Backend, backend_for_tensor
from ..backends.base import NOISE_PHILOX
from ..backends.formats import rejection_output
from ..backends.sampling_rules import draw_seeds, tempered_logits
from ..backends.transfer import to_device
from ..checks import is_integer
from .ops import as_generator_dict, check_top_p_values

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_SPEC_LEN",
    "PLACEHOLDER_TOKEN_ID",
    "chain_speculative_sampling",
    "parse_output",
    "rejection_sample",
]

MAX_SPEC_LEN = 128  # vLLM's limit on draft tokens per request and step
PLACEHOLDER_TOKEN_ID = -1  # a draft slot without a token; never accepted; pads the output

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclass
class _Batch:
    """Validated inputs on the logits' device."""

    counts: list[int]
    cu: torch.Tensor  # int32 (B,) end offsets
    starts: torch.Tensor  # int64 (B,)
    count_tensor: torch.Tensor  # int64 (B,)
    token_request: torch.Tensor  # int64 (N,): the request of each draft
    draft_token_ids: torch.Tensor
    target_logits: torch.Tensor
    bonus: torch.Tensor  # (B,)
    draft_probs: torch.Tensor | None
    width: int

    @property
    def batch_size(self) -> int:
        return len(self.counts)

    @property
    def vocab_size(self) -> int:
        return self.target_logits.shape[-1]


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int] | torch.Tensor,
    target_logits: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    *,
    draft_probs: torch.Tensor | None = None,
    temperature: torch.Tensor | Sequence[float] | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    generators: Mapping[int, torch.Generator] | None = None,
    backend: str | torch.device | Backend | None = None,
) -> torch.Tensor:
    """Verify speculative drafts against the target model; int32 (B, max(num_draft_tokens) + 1).

    draft_token_ids: int (N,), the drafts of all requests back to back (-1 = placeholder, rejected).
    num_draft_tokens: drafts per request (B ints, each <= 128; a device tensor costs a host sync).
    target_logits: float (N, V), raw target logits at each draft position.
    bonus_token_ids: int (B,) or (B, 1), emitted when every draft of the request was accepted.
    draft_probs: float (N, V) draft-model probabilities, or None for n-gram drafts (a point mass).
    temperature: (B,) per request; 0 makes that request greedy; None makes every request greedy.
    top_k / top_p: (B,) per request, applied with temperature to the target (never to draft_probs).
    generators: request index -> torch.Generator, for reproducible requests.

    Greedy requests accept while the draft equals the target argmax and emit the argmax at the first
    mismatch. Random requests accept while target_p / draft_p >= u (u ~ U[0, 1) in float64, one per
    draft) and emit a token drawn from max(target - draft, 0) (normalised) at the first rejection,
    so every emitted token is distributed as the target. Inputs are not modified.
    """
    batch = _check_batch(draft_token_ids, num_draft_tokens, target_logits, bonus_token_ids, draft_probs)
    device = batch.target_logits.device
    generators = as_generator_dict(generators, batch.batch_size, device)
    if batch.batch_size == 0:
        return torch.empty((0, 1), dtype=torch.int32, device=device)
    be = backend_for_tensor(batch.target_logits, backend)
    temperature, has_greedy, has_random = _check_temperature(temperature, batch.batch_size, device)
    top_k = _check_per_request("top_k", top_k, batch.batch_size, device, integer=True)
    top_p = _check_per_request("top_p", top_p, batch.batch_size, device, integer=False, check_values=check_top_p_values)
    num_tokens = batch.draft_token_ids.numel()
    if num_tokens == 0 or not has_random:
        return _verify(be, batch, None, None, None, None, None)[0]
    uniform = noise = None
    if top_k is None and top_p is None:
        uniform = draw_draft_uniforms(batch.counts, num_tokens, generators, device)
        noise = draw_recovery_noise(be, batch.counts, batch.vocab_size, generators, device)
        verified = _verify_in_one_go(be, batch, temperature, uniform, noise, False)
        if verified is not None:
            return verified[0]

    token_request = batch.token_request
    is_greedy = (temperature == 0) if has_greedy else None
    token_temperature = temperature[token_request]
    token_temperature = torch.where(token_temperature == 0, 1.0, token_temperature)  # greedy rows: unused
    logits = batch.target_logits
    if top_k is not None or top_p is not None:
        # vLLM's order: temperature, then top-k/top-p on the tempered logits (one new tensor).
        from .ops import apply_top_k_top_p

        logits = apply_top_k_top_p(
            tempered_logits(logits, token_temperature),
            None if top_k is None else top_k[token_request],
            None if top_p is None else top_p[token_request],
        )
        token_temperature = None
    if uniform is None:
        uniform = draw_draft_uniforms(batch.counts, num_tokens, generators, device)
        noise = draw_recovery_noise(be, batch.counts, batch.vocab_size, generators, device)
    return _verify(be, batch, logits, token_temperature, is_greedy, uniform, noise)[0]


def _verify_in_one_go(
    be: Backend, batch: _Batch, temperature: torch.Tensor | None, uniform, noise, all_greedy: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(output, accepted) from the backend's one-go verification (batches without top-k/top-p;
    temperature per request, None = 1 for all), or None where it verifies step by step."""
    noise_tensor = None
    if noise is not None:
        noise_tensor, event = noise
        be.wait_event(event)
    return be.rejection_verify(
        batch.cu, batch.token_request, batch.draft_token_ids, batch.target_logits, temperature, batch.draft_probs,
        uniform, noise_tensor, batch.bonus, batch.width, all_greedy,
    )


def _verify(
    be: Backend,
    batch: _Batch,
    logits: torch.Tensor | None,
    token_temperature: torch.Tensor | None,
    is_greedy: torch.Tensor | None,
    uniform: torch.Tensor | None,
    noise: tuple[torch.Tensor, object] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, accepted drafts per request). `logits is None` means every request is greedy;
    otherwise `is_greedy` (None = no greedy request) selects the greedy ones and the rest are
    verified randomly against `logits` (raw or processed) with the pre-drawn `uniform` / `noise`."""
    if batch.draft_token_ids.numel() == 0:
        accepted = torch.zeros(batch.batch_size, dtype=torch.int32, device=batch.cu.device)
        return rejection_output(batch.starts, batch.draft_token_ids, accepted, batch.bonus, batch.width), accepted
    if logits is None and (verified := _verify_in_one_go(be, batch, None, None, None, True)) is not None:
        return verified
    greedy_result = None
    if logits is None or is_greedy is not None:
        greedy_result = be.rejection_greedy_accept(batch.cu, batch.draft_token_ids, batch.target_logits, is_greedy)
    if logits is None:
        accepted, correction = greedy_result
    else:
        active = None if is_greedy is None else ~is_greedy
        accepted, row_lse = be.rejection_random_accept(
            batch.cu, batch.draft_token_ids, logits, token_temperature, batch.draft_probs, uniform, active
        )
        noise_tensor, event = noise
        be.wait_event(event)
        correction = be.rejection_recover(
            batch.cu, batch.draft_token_ids, logits, token_temperature, batch.draft_probs, accepted, row_lse,
            noise_tensor, active,
        )
        if greedy_result is not None:
            accepted = torch.where(is_greedy, greedy_result[0], accepted)
            correction = torch.where(is_greedy, greedy_result[1], correction)
    final = torch.where(accepted.to(torch.int64) < batch.count_tensor, correction.to(torch.int64), batch.bonus.to(torch.int64))
    return rejection_output(batch.starts, batch.draft_token_ids, accepted, final, batch.width), accepted


# ---- random numbers (drawn here, so the kernels stay pure functions of their inputs) ----


def draw_draft_uniforms(
    counts: Sequence[int], num_tokens: int, generators: Mapping[int, torch.Generator], device: torch.device
) -> torch.Tensor:
    """float64 (N,) uniforms for the acceptance tests; a request with a generator draws its own, in
    order (float64 because float32 draws hit exactly 0 too often). Requests without drafts draw
    nothing from their generator, as in vLLM."""
    uniform = torch.rand(num_tokens, dtype=torch.float64, device=device)
    start = 0
    for request, count in enumerate(counts):
        generator = generators.get(request)
        if generator is not None and count:
            uniform[start : start + count].uniform_(generator=generator)
        start += count
    return uniform


def draw_recovery_noise(
    be: Backend, counts: Sequence[int], vocab_size: int, generators: Mapping[int, torch.Generator], device: torch.device
) -> tuple[torch.Tensor, object]:
    """(noise, event) for `be.rejection_recover`: one float64 uniform per request (inverse CDF),
    one int64 seed per request (NOISE_PHILOX: the kernel generates the race's noise), or float32
    (B, V) Exp(1) draws queued on the backend's side stream (the race). Wait on `event` before
    reading the noise."""
    batch = len(counts)
    if be.recovery_noise == NOISE_PHILOX:
        drawing = {request: generator for request, generator in generators.items() if counts[request]}
        return draw_seeds(batch, drawing, device), None
    if be.recovery_noise == "uniform":
        noise = torch.rand(batch, dtype=torch.float64, device=device)
        for request, generator in generators.items():
            if counts[request]:
                noise[request : request + 1].uniform_(generator=generator)
        return noise, None
    noise = torch.empty((batch, vocab_size), dtype=torch.float32, device=device)  # owned by the main stream
    with be.side_stream():
        noise.exponential_()
        for request, generator in generators.items():
            if counts[request]:
                noise[request].exponential_(generator=generator)
        event = be.record_event()
    return noise, event


# ---- validation (the public boundary) ----


def _is_int(t: torch.Tensor) -> bool:
    return t.dtype in _INT_DTYPES


def check_num_draft_tokens(num_draft_tokens: Sequence[int] | torch.Tensor) -> list[int]:
    """The per-request draft counts as a list of ints, each in [0, MAX_SPEC_LEN]."""
    if isinstance(num_draft_tokens, torch.Tensor):
        if num_draft_tokens.dim() != 1 or not _is_int(num_draft_tokens):
            raise ValueError(f"num_draft_tokens must be a 1-D integer tensor, got {num_draft_tokens.dtype} {tuple(num_draft_tokens.shape)}")
        counts = num_draft_tokens.tolist()  # a host sync for device tensors: pass a list
    else:
        counts = list(num_draft_tokens)
    for request, count in enumerate(counts):
        if not is_integer(count) or count < 0:
            raise ValueError(f"num_draft_tokens[{request}] = {count!r} is not a non-negative int")
        if count > MAX_SPEC_LEN:
            raise ValueError(
                f"request {request} has {count} draft tokens; the maximum speculative length is {MAX_SPEC_LEN}"
            )
    return [int(c) for c in counts]


def _check_batch(draft_token_ids, num_draft_tokens, target_logits, bonus_token_ids, draft_probs) -> _Batch:
    for name, value in (("draft_token_ids", draft_token_ids), ("target_logits", target_logits), ("bonus_token_ids", bonus_token_ids)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a torch tensor, got {type(value).__name__}")
    counts = check_num_draft_tokens(num_draft_tokens)
    num_tokens = sum(counts)
    if draft_token_ids.dim() != 1 or not _is_int(draft_token_ids):
        raise ValueError(f"draft_token_ids must be a 1-D integer tensor, got {draft_token_ids.dtype} {tuple(draft_token_ids.shape)}")
    if draft_token_ids.numel() != num_tokens:
        raise ValueError(f"draft_token_ids has {draft_token_ids.numel()} tokens but num_draft_tokens sums to {num_tokens}")
    if target_logits.dim() != 2 or not target_logits.is_floating_point() or target_logits.shape[-1] == 0:
        raise ValueError(f"target_logits must be a 2-D float tensor (N, V) with V > 0, got {target_logits.dtype} {tuple(target_logits.shape)}")
    if target_logits.shape[0] != num_tokens:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows but there are {num_tokens} draft tokens")
    device = target_logits.device
    vocab = target_logits.shape[-1]
    if draft_token_ids.device != device:
        raise ValueError(f"draft_token_ids are on {draft_token_ids.device} but target_logits on {device}")
    bonus = bonus_token_ids.reshape(-1) if bonus_token_ids.dim() == 2 and bonus_token_ids.shape[-1] == 1 else bonus_token_ids
    if bonus.dim() != 1 or bonus.numel() != len(counts) or not _is_int(bonus):
        raise ValueError(
            f"bonus_token_ids must be an integer tensor of shape ({len(counts)},) or ({len(counts)}, 1), "
            f"got {bonus_token_ids.dtype} {tuple(bonus_token_ids.shape)}"
        )
    if bonus.device != device:
        raise ValueError(f"bonus_token_ids are on {bonus.device} but target_logits on {device}")
    if device.type == "cpu":  # free on the host; on a device this check would be a sync
        bad = ((bonus < 0) | (bonus >= vocab)).nonzero()
        if bad.numel():
            request = int(bad[0, 0])
            raise ValueError(f"bonus token {int(bonus[request])} of request {request} is outside the vocabulary [0, {vocab})")
    if draft_probs is not None:
        if not isinstance(draft_probs, torch.Tensor) or not draft_probs.is_floating_point():
            raise ValueError("draft_probs must be a float tensor (N, V) or None")
        if tuple(draft_probs.shape) != tuple(target_logits.shape):
            raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)} but target_logits {tuple(target_logits.shape)}")
        if draft_probs.device != device:
            raise ValueError(f"draft_probs are on {draft_probs.device} but target_logits on {device}")
    cu, starts, count_tensor, token_request = host_spec_layout(counts, device)
    return _Batch(
        counts, cu, starts, count_tensor, token_request, draft_token_ids, target_logits, bonus, draft_probs,
        max(counts, default=0) + 1,
    )


def host_spec_layout(counts: Sequence[int], device: torch.device):
    """(cu int32, starts, counts, request of each token) built on the host from the counts and
    copied without a sync. numpy, not torch: torch's small parallel ops (searchsorted,
    repeat_interleave) stall for milliseconds on a busy CPU behind numba's OpenMP threads."""
    sizes = np.asarray(counts, dtype=np.int64)
    ends = np.cumsum(sizes)
    host = (ends.astype(np.int32), ends - sizes, sizes, np.repeat(np.arange(len(sizes), dtype=np.int64), sizes))
    return tuple(to_device(torch.from_numpy(a), device) for a in host)


def _check_temperature(temperature, batch_size: int, device: torch.device) -> tuple[torch.Tensor | None, bool, bool]:
    """(temperature float32 on device or None, any greedy request, any random request). Both flags
    are True when the values live on a device (reading them would be a sync)."""
    if temperature is None:
        return None, True, False
    if not isinstance(temperature, torch.Tensor):
        temperature = torch.tensor(list(temperature), dtype=torch.float32)
    if temperature.dim() != 1 or temperature.numel() != batch_size or not temperature.is_floating_point():
        raise ValueError(f"temperature must be a float tensor of shape ({batch_size},), got {temperature.dtype} {tuple(temperature.shape)}")
    if temperature.device.type == "cpu":
        bad = (~torch.isfinite(temperature) | (temperature < 0)).nonzero()
        if bad.numel():
            request = int(bad[0, 0])
            raise ValueError(f"temperature {float(temperature[request])} of request {request} must be finite and >= 0")
        greedy = temperature == 0
        has_greedy, has_random = bool(greedy.any()), not bool(greedy.all())
    elif temperature.device != device:
        raise ValueError(f"temperature is on {temperature.device} but target_logits on {device}")
    else:
        has_greedy = has_random = True
    return to_device(temperature, device, torch.float32), has_greedy, has_random


def _check_per_request(name: str, value, batch_size: int, device: torch.device, *, integer: bool, check_values=None):
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.numel() != batch_size:
        raise ValueError(f"{name} must be a 1-D tensor of shape ({batch_size},)")
    if integer != _is_int(value) or (not integer and not value.is_floating_point()):
        raise ValueError(f"{name} must be an {'integer' if integer else 'float'} tensor, got {value.dtype}")
    if value.device.type != "cpu" and value.device != device:
        raise ValueError(f"{name} is on {value.device} but target_logits on {device}")
    if check_values is not None:
        check_values(value, name)  # before the copy to the device: reading host values is free
    return to_device(value, device)


# ---- outputs and the probability-level convenience API ----


def parse_output(output_token_ids: torch.Tensor, vocab_size: int) -> list[list[int]]:
    """Per-request emitted token lists (drops -1 padding and ids outside [0, vocab_size)); one host
    copy — call it when the tokens are needed as Python ints."""
    rows = output_token_ids.cpu()
    valid = (rows >= 0) & (rows < vocab_size)
    return [row[mask].tolist() for row, mask in zip(rows, valid)]


def chain_speculative_sampling(
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    maybe_output_accepted_token_num: torch.Tensor | None = None,
    maybe_output_emitted_draft_token_num: torch.Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
    backend: str | torch.device | Backend | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's `chain_speculative_sampling` for callers holding probabilities.

    draft_probs (B, K, V), draft_token_ids (B, K), target_probs (B, K + 1, V) -> (output_token_ids
    int32 (B, K + 1) padded with -1, accepted_token_num (B,): drafts that pass the test when each is
    considered independently, emitted_draft_token_num (B,): drafts emitted). As in FlashInfer the two
    counters are added in place to the tensors passed in. When every draft is accepted the last token
    is drawn from target_probs[:, K]. `generator` drives all the random numbers of the batch.
    """
    if draft_probs.dim() != 3 or draft_token_ids.dim() != 2 or target_probs.dim() != 3:
        raise ValueError("expected draft_probs (B, K, V), draft_token_ids (B, K) and target_probs (B, K + 1, V)")
    b, k, vocab = draft_probs.shape
    if tuple(draft_token_ids.shape) != (b, k) or tuple(target_probs.shape) != (b, k + 1, vocab):
        raise ValueError(
            f"shapes disagree: draft_probs {tuple(draft_probs.shape)}, draft_token_ids {tuple(draft_token_ids.shape)}, "
            f"target_probs {tuple(target_probs.shape)} (expected ({b}, {k}) and ({b}, {k + 1}, {vocab}))"
        )
    if k + 1 > MAX_SPEC_LEN:
        raise ValueError(f"{k} draft tokens per request; the maximum speculative length is {MAX_SPEC_LEN - 1} here")
    device = target_probs.device
    # The bonus is one more "draft": a placeholder, always rejected, whose recovered token is a
    # draw from the target row K — so one verification pass samples it too.
    drafts = torch.cat([draft_token_ids.to(torch.int64), draft_token_ids.new_full((b, 1), PLACEHOLDER_TOKEN_ID).to(torch.int64)], 1)
    probs = torch.cat([draft_probs.float(), draft_probs.new_zeros(b, 1, vocab, dtype=torch.float32)], 1)
    counts = [k + 1] * b
    batch = _check_batch(
        drafts.reshape(-1), counts, target_probs.float().log().reshape(b * (k + 1), vocab),
        torch.zeros(b, dtype=torch.int64, device=device), probs.reshape(b * (k + 1), vocab),
    )
    be = backend_for_tensor(batch.target_logits, backend)
    generators = {} if generator is None else as_generator_dict(dict.fromkeys(range(b), generator), b, device)
    uniform = draw_draft_uniforms(counts, b * (k + 1), generators, device)
    noise = draw_recovery_noise(be, counts, vocab, generators, device)
    verified = _verify_in_one_go(be, batch, None, uniform, noise, False)
    out, accepted = verified if verified is not None else _verify(be, batch, batch.target_logits, None, None, uniform, noise)
    out = out[:, : k + 1].contiguous()

    ids = draft_token_ids.to(torch.int64)
    valid = (ids >= 0) & (ids < vocab)
    safe = ids.clamp(0, vocab - 1).unsqueeze(-1)
    target_p = target_probs[:, :k].gather(-1, safe).squeeze(-1).double()
    draft_p = draft_probs.gather(-1, safe).squeeze(-1).double()
    passes = valid & (draft_p > 0) & (target_p > 0) & (target_p / draft_p >= uniform.view(b, k + 1)[:, :k])
    accepted_num = passes.sum(-1).to(torch.int32)
    if maybe_output_accepted_token_num is not None:
        accepted_num = maybe_output_accepted_token_num.add_(accepted_num.to(maybe_output_accepted_token_num.dtype))
    emitted = accepted
    if maybe_output_emitted_draft_token_num is not None:
        emitted = maybe_output_emitted_draft_token_num.add_(accepted.to(maybe_output_emitted_draft_token_num.dtype))
    return out, accepted_num, emitted
