"""Sampling operations: temperature, top-k / top-p / min-p filters and exact random draws.

Public functions check shapes, dtypes and devices (metadata only: no host sync) and hand the work
to the backend of the tensors' device. Filters work in place on float logits and return them.

For speculative decoding (rejection sampling) the target logits of every draft position are
filtered exactly like a sampling step's logits:

    apply_sampling_constraints(target_logits, temperature, top_k, top_p)

with per-row tensors already expanded to one entry per target-logits row (vLLM's
`apply_sampling_constraints` + `apply_top_k_top_p`).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from ..backends import Backend, backend_for_tensor, get_backend
from ..backends.base import NOISE_EXPONENTIAL, NOISE_PHILOX, NOISE_UNIFORM, SamplingNoise
from ..backends.sampling_rules import undefined_logit_rows
from ..checks import is_integer
from .params import SAMPLING_EPS

logger = logging.getLogger(__name__)

__all__ = [
    "SamplingNoise",
    "apply_min_p",
    "apply_sampling_constraints",
    "apply_temperature",
    "apply_top_k_top_p",
    "as_generator_dict",
    "compute_probs",
    "draw_sampling_noise",
    "random_sample",
    "sample_from_logits",
    "top_k_top_p_probs",
    "undefined_row_fallback",
]

Generators = Mapping[int, torch.Generator] | Sequence[torch.Generator | None] | None
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_logits(logits: torch.Tensor, name: str = "logits") -> None:
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"{name} must be a torch tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, vocab), got shape {tuple(logits.shape)}")
    if logits.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {logits.dtype}")


def _check_rows(values: torch.Tensor | None, logits: torch.Tensor, name: str, integer: bool) -> None:
    if values is None:
        return
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{name} must be a tensor with one value per row, got {type(values).__name__}")
    if values.shape != (logits.shape[0],):
        raise ValueError(f"{name} must have shape ({logits.shape[0]},) (one value per row), got {tuple(values.shape)}")
    if integer != (not values.dtype.is_floating_point):
        raise ValueError(f"{name} must be an {'integer' if integer else 'floating-point'} tensor, got {values.dtype}")
    if values.device != logits.device:
        raise ValueError(f"{name} is on {values.device} but logits are on {logits.device}")


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor, *, all_random: bool = False) -> torch.Tensor:
    """In place: divide each row by its temperature. Rows below SAMPLING_EPS (greedy) are divided
    by 1 instead (never by 0); pass all_random=True when no row is greedy to skip that check."""
    check_logits(logits)
    _check_rows(temperature, logits, "temperature", integer=False)
    if not all_random:
        temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
    return logits.div_(temperature.unsqueeze(1).to(logits.dtype))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """In place: remove tokens whose probability is below min_p times the row's largest
    probability (min_p 0 keeps the row)."""
    check_logits(logits)
    _check_rows(min_p, logits, "min_p", integer=False)
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(torch.float32).unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def check_top_p_values(p: torch.Tensor | None, name: str = "p") -> None:
    """top_p <= 0 (or NaN) has no meaning: reject it where reading the values is free (a host
    tensor); a device tensor is not read (that would be a sync) and behaves as documented in
    backends/sampling_rules.py."""
    if p is None or p.device.type != "cpu":
        return
    bad = (~(p > 0)).nonzero()
    if bad.numel():
        row = int(bad[0, 0])
        raise ValueError(f"{name}[{row}] = {float(p[row])} is not a valid top_p: it must be in (0, 1] (1 keeps the row)")


def undefined_row_fallback(
    logits: torch.Tensor, temperature: torch.Tensor | None = None, *, backend: str | torch.device | Backend | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(undefined bool (B,), fallback int64 (B,) or None): the rows of logits / temperature that
    have no distribution (a NaN, a +inf, nothing above -inf) and the token each of them is sampled
    as (backends/sampling_rules.py: the argmax with NaN ignored, 0 when nothing is left). fallback is
    None when the backend knows for free that every row is defined; no host sync on devices."""
    undefined = undefined_logit_rows(logits, temperature)
    return undefined, backend_for_tensor(logits, backend).undefined_row_fallback(logits, undefined)


def apply_top_k_top_p(
    logits: torch.Tensor,
    k: torch.Tensor | None,
    p: torch.Tensor | None,
    *,
    max_top_k: int | None = None,
    backend: str | torch.device | Backend | None = None,
) -> torch.Tensor:
    """In place: top-k, then top-p on the softmax of what top-k kept (vLLM's order).

    k: int (B,), 0 / -1 / >= V keep the row; p: float (B,) in (0, 1], 1 keeps the row (p <= 0 in a
    host tensor raises ValueError). Ties at the cut
    are kept together. `max_top_k`, when the caller knows it on the host (SamplingMetadata does), is
    max(k) if every row has a top-k, and lets GPU/NPU backends use torch.topk instead of a sort.
    Semantics: backends/sampling_rules.py (the sort-based reference: backends/reference/sampling.py). Returns logits.
    """
    check_logits(logits)
    _check_rows(k, logits, "k", integer=True)
    _check_rows(p, logits, "p", integer=False)
    check_top_p_values(p)
    if (k is None and p is None) or logits.shape[0] == 0:
        return logits
    chosen = backend_for_tensor(logits, backend)
    # Kernels take contiguous float32; other layouts are filtered on a copy and written back.
    work = logits if logits.dtype == torch.float32 and logits.is_contiguous() else logits.to(torch.float32).contiguous()
    filtered = chosen.apply_top_k_top_p(work, k, p, max_top_k)
    return logits if filtered is logits else logits.copy_(filtered)


def top_k_top_p_probs(
    logits: torch.Tensor,
    k: torch.Tensor | None,
    p: torch.Tensor | None,
    *,
    max_top_k: int | None = None,
    backend: str | torch.device | Backend | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, probs): `apply_top_k_top_p` in place, then float32 probabilities to draw from with
    `random_sample` (the softmax of the filtered logits, per row up to a positive factor; backends
    whose filter computes a softmax anyway reuse it)."""
    check_logits(logits)
    _check_rows(k, logits, "k", integer=True)
    _check_rows(p, logits, "p", integer=False)
    check_top_p_values(p)
    if (k is None and p is None) or logits.shape[0] == 0 or logits.dtype != torch.float32 or not logits.is_contiguous():
        logits = apply_top_k_top_p(logits, k, p, max_top_k=max_top_k, backend=backend)
        return logits, compute_probs(logits)
    filtered, probs = backend_for_tensor(logits, backend).top_k_top_p_probs(logits, k, p, max_top_k)
    return (logits if filtered is logits else logits.copy_(filtered)), probs


def apply_sampling_constraints(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    *,
    max_top_k: int | None = None,
    backend: str | torch.device | Backend | None = None,
) -> torch.Tensor:
    """What random sampling does to logits before the softmax, in place: temperature per row
    (0 = greedy: the row is left unscaled), then top-k, then top-p. Every argument has one entry
    per logits row; None skips that step. Rejection sampling calls this on the target logits with
    the per-request values repeated for each draft position."""
    if temperature is not None:
        apply_temperature(logits, temperature)
    return apply_top_k_top_p(logits, top_k, top_p, max_top_k=max_top_k, backend=backend)


def compute_probs(logits: torch.Tensor) -> torch.Tensor:
    """float32 softmax over the vocabulary."""
    return logits.softmax(dim=-1, dtype=torch.float32)


def as_generator_dict(generators: Generators, batch_size: int, device: torch.device) -> dict[int, torch.Generator]:
    """Row -> generator from a dict (vLLM's form) or a per-row sequence with None for rows
    without one; checks rows and devices."""
    if generators is None:
        return {}
    if isinstance(generators, Mapping):
        items = list(generators.items())
    elif isinstance(generators, Sequence):
        if len(generators) != batch_size:
            raise ValueError(f"generators has {len(generators)} entries for {batch_size} rows")
        items = [(row, g) for row, g in enumerate(generators) if g is not None]
    else:
        raise ValueError(f"generators must be a dict row -> torch.Generator or a list, got {type(generators).__name__}")
    out = {}
    for row, generator in items:
        if not is_integer(row) or not 0 <= row < batch_size:
            raise ValueError(f"generators has row {row!r}, outside [0, {batch_size})")
        if not isinstance(generator, torch.Generator):
            raise ValueError(f"generators[{row}] must be a torch.Generator, got {type(generator).__name__}")
        if generator.device.type != device.type:
            raise ValueError(f"generators[{row}] is a {generator.device} generator but the tensors are on {device}")
        out[row] = generator
    return out


def draw_sampling_noise(
    batch_size: int,
    vocab_size: int,
    generators: Generators = None,
    *,
    backend: str | torch.device | Backend | None = None,
) -> SamplingNoise:
    """Draw the random numbers for a later `random_sample(probs, generators, noise=...)` of shape
    (batch_size, vocab_size) now, on the backend's side stream: call it before the model's forward
    pass so the draw overlaps it (the exponential trick's (B, V) noise on GPU/NPU; B uniforms on
    CPU). Rows with a generator consume it here, in the same amounts as without prefetching."""
    if batch_size < 0 or vocab_size <= 0:
        raise ValueError(f"need batch_size >= 0 and vocab_size > 0, got {batch_size} and {vocab_size}")
    chosen = get_backend(backend)
    return chosen.draw_sampling_noise(batch_size, vocab_size, as_generator_dict(generators, batch_size, chosen.device))


def check_noise(noise: SamplingNoise, probs: torch.Tensor, backend: Backend) -> None:
    """ValueError unless `noise` (from draw_sampling_noise) is unused and fits probs (B, V) on backend."""
    if not isinstance(noise, SamplingNoise):
        raise ValueError(f"noise must come from draw_sampling_noise, got {type(noise).__name__}")
    if noise.consumed:
        raise ValueError("noise was already used by a random_sample call; draw new noise for each step")
    if noise.kind != backend.sampling_noise_kind:
        raise ValueError(f"noise is {noise.kind!r} but backend {backend.name!r} samples with {backend.sampling_noise_kind!r} noise")
    expected = {NOISE_EXPONENTIAL: tuple(probs.shape), NOISE_UNIFORM: (probs.shape[0],), NOISE_PHILOX: (probs.shape[0],)}[noise.kind]
    if noise.shape != expected:
        raise ValueError(f"noise has shape {noise.shape} but probs of shape {tuple(probs.shape)} need {expected}")
    if noise.values.device != probs.device:
        raise ValueError(f"noise is on {noise.values.device} but probs are on {probs.device}")


def random_sample(
    probs: torch.Tensor,
    generators: Generators = None,
    *,
    backend: str | torch.device | Backend | None = None,
    noise: SamplingNoise | None = None,
) -> torch.Tensor:
    """int64 (B,): one exact draw from each row of probs (B, V) (non-negative; rows need not sum
    to 1). Rows with a generator are reproducible for the same seed on the same backend. A row
    whose total is not a finite positive number (NaN, inf, all 0) gives its argmax with NaN
    ignored (token 0 when nothing is left), the same on every backend.

    GPU / NPU: the exponential trick argmax(p / q), q ~ Exp(1), with q drawn on the backend's side
    stream and waited for with an event (no host sync); CPU: an inverse-CDF draw with one uniform
    per row. `noise` from `draw_sampling_noise` (same shape and generators) moves the draw ahead.
    """
    check_logits(probs, "probs")
    chosen = backend_for_tensor(probs, backend)
    rows = as_generator_dict(generators, probs.shape[0], probs.device)
    if noise is not None:
        check_noise(noise, probs, chosen)
        noise.consumed = True
    if probs.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=probs.device)
    return chosen.random_sample(probs, rows, noise)


def sample_from_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    k: torch.Tensor | None,
    p: torch.Tensor | None,
    generators: Generators = None,
    *,
    max_top_k: int | None = None,
    backend: str | torch.device | Backend | None = None,
    noise: SamplingNoise | None = None,
    all_random: bool = False,
) -> torch.Tensor | None:
    """int64 (B,): one draw per row from softmax(top-p(top-k(logits / temperature))) in one go,
    rows without a distribution given their fallback token; the logits are not modified. None when
    the backend has no such kernel for these arguments (CUDA's v2 sampling has one for batches whose
    every row has a top-k, `max_top_k` known on the host): then filter and draw step by step
    (`top_k_top_p_probs`, `random_sample`), with the same `noise`, which is left unused.
    temperature: per row, below SAMPLING_EPS counts as 1 (all_random=True: no row is below it, skip
    that check); None when the logits are already tempered."""
    check_logits(logits)
    _check_rows(temperature, logits, "temperature", integer=False)
    _check_rows(k, logits, "k", integer=True)
    _check_rows(p, logits, "p", integer=False)
    check_top_p_values(p)
    chosen = backend_for_tensor(logits, backend)
    if not chosen.fused_logit_sampling or logits.dtype != torch.float32 or logits.shape[0] == 0:
        return None
    rows = as_generator_dict(generators, logits.shape[0], logits.device)
    if noise is not None:
        check_noise(noise, logits, chosen)
    if temperature is not None and not all_random:
        temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature.to(torch.float32))
    sampled = chosen.sample_from_logits(logits, temperature, k, p, max_top_k, rows, noise)
    if sampled is not None and noise is not None:
        noise.consumed = True
    return sampled
