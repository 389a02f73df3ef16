"""The per-step sampler, in vLLM v1's order:

1. raw log-probabilities (when asked for, logprobs_mode="raw_logprobs", vLLM's default);
2. float32 logits; the non-argmax-invariant logits processors;
3. greedy rows: argmax (all-greedy batches stop here and skip the argmax-invariant processors);
4. temperature (greedy rows divided by 1, never by 0); the argmax-invariant processors (MinP);
5. top-k then top-p; softmax (on CPU the one top-p computed, with the removed tokens zeroed); one
   exact random draw per row (`ops.random_sample`); a backend that does step 5 in one go
   (`ops.sample_from_logits`: CUDA's v2 sampling, with every row's top-k known) does it instead,
   with step 4's temperature folded in when no min-p or argmax-invariant processor needs it;
6. greedy and random rows merged; optional log-probabilities (top-n, plus the sampled token's
   log-probability and rank).

No step syncs with the host: the result stays on the device until the caller reads it.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..backends import Backend, backend_for_tensor, get_backend
from ..backends.base import SamplingNoise
from ..backends.transfer import to_device
from ..checks import is_integer
from . import ops
from .params import SAMPLING_EPS, SamplingParams, SamplingType
from .processors.state import LogitsProcessors

logger = logging.getLogger(__name__)

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "SamplingMetadata", "make_generator"]

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own generator: its draws depend on its seed alone."""
    return torch.Generator(device=device).manual_seed(seed)


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for a batch of B rows (vLLM's SamplingMetadata).

    temperature: float32 (B,) or None when every row is greedy; top_k: int64 (B,) (0 = off) or
    None; top_p: float32 (B,) (1 = off) or None; generators: row -> the request's generator;
    max_num_logprobs: the largest `logprobs` in the batch (None: no logprobs); max_top_k: max(top_k)
    known on the host when every row has a top-k (lets GPU/NPU use torch.topk instead of a sort);
    max_random_top_k: max(top_k) over the random rows when each of them has a top-k (greedy rows
    have none), which is what a backend that filters and draws in one go needs;
    noise: the random numbers drawn ahead by `prefetch_noise`; min_p: float32 (B,) (0 = off) or
    None, applied after temperature like vLLM's MinP processor (the processor is the usual way;
    this field serves layouts where a processor's per-batch state does not fit, see sampling/sparse.py).
    """

    temperature: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None
    logitsprocs: LogitsProcessors = field(default_factory=LogitsProcessors)
    max_top_k: int | None = None
    noise: SamplingNoise | None = None
    min_p: torch.Tensor | None = None
    max_random_top_k: int | None = None

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        *,
        device: torch.device | str = "cpu",
        generators: Mapping[int, torch.Generator] | None = None,
        logitsprocs: LogitsProcessors | None = None,
    ) -> SamplingMetadata:
        """Metadata for rows sampled with `params[i]`; `generators` maps rows to the generators of
        requests with a seed (kept by the caller across steps). Greedy rows never draw."""
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params[{i}] must be a SamplingParams, got {type(p).__name__}")
        for row, generator in (generators or {}).items():
            if not is_integer(row) or not 0 <= row < len(params):
                raise ValueError(f"generators has row {row!r}, outside [0, {len(params)})")
            if not isinstance(generator, torch.Generator):
                raise ValueError(f"generators[{row}] must be a torch.Generator, got {type(generator).__name__}")
        device = torch.device(device)
        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)

        def upload(values, dtype):
            return to_device(torch.tensor(values, dtype=dtype), device)

        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        any_top_k = any(k > 0 for k in top_k)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=None if all_greedy else upload([p.temperature for p in params], torch.float32),
            all_greedy=all_greedy,
            all_random=all_random,
            top_p=upload(top_p, torch.float32) if any(v < 1 for v in top_p) and not all_greedy else None,
            top_k=upload(top_k, torch.int64) if any_top_k and not all_greedy else None,
            generators={row: g for row, g in (generators or {}).items() if not greedy[row]},
            max_num_logprobs=max(logprobs) if logprobs else None,
            logitsprocs=logitsprocs if logitsprocs is not None else LogitsProcessors(),
            max_top_k=max(top_k) if any_top_k and all(k > 0 for k in top_k) else None,
            max_random_top_k=max(random_k) if (random_k := [k for k, g in zip(top_k, greedy) if not g])
            and all(k > 0 for k in random_k) else None,
        )

    def prefetch_noise(self, batch_size: int, vocab_size: int, *, backend: str | torch.device | Backend | None = None) -> None:
        """Draw this step's sampling noise now, on the backend's side stream, so that it overlaps
        the model's forward pass (nothing to draw for all-greedy batches)."""
        if not self.all_greedy:
            self.noise = ops.draw_sampling_noise(batch_size, vocab_size, self.generators, backend=backend)


class LogprobsTensors(NamedTuple):
    """Per row: the sampled token then the top-n tokens, their log-probabilities, and the sampled
    token's rank (1 = the most likely; ties rank together)."""

    logprob_token_ids: torch.Tensor  # int32 (B, n + 1)
    logprobs: torch.Tensor  # float32 (B, n + 1)
    selected_token_ranks: torch.Tensor  # int64 (B,)

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """Python lists (a host sync: call it after the step)."""
        return self.logprob_token_ids.tolist(), self.logprobs.tolist(), self.selected_token_ranks.tolist()


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor  # int32 (B, 1), as vLLM's
    logprobs_tensors: LogprobsTensors | None


class Sampler:
    """Samples one token per row from float logits (B, V) given SamplingMetadata.

    logprobs_mode: "raw_logprobs" (of the model's logits, vLLM's default) or "processed_logprobs"
    (after processors, temperature and top-k/top-p). The logits may be modified in place.
    """

    def __init__(self, *, logprobs_mode: str = "raw_logprobs", backend: str | torch.device | Backend | None = None) -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self.backend = None if backend is None else get_backend(backend)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        ops.check_logits(logits)
        if metadata.max_num_logprobs is not None and metadata.max_num_logprobs > logits.shape[-1]:
            raise ValueError(
                f"logprobs={metadata.max_num_logprobs} asks for more log-probabilities than the "
                f"{logits.shape[-1]} logits per row (SamplingParams.verify(vocab_size) catches it per request)"
            )
        raw_logprobs = None
        if metadata.max_num_logprobs is not None and self.logprobs_mode == "raw_logprobs":
            raw_logprobs = compute_logprobs(logits)
        logits = logits.to(torch.float32)
        for processor in metadata.logitsprocs.non_argmax_invariant:
            logits = processor.apply(logits)
        sampled, processed_logprobs = self._sample(logits, metadata)
        logprobs_tensors = None
        if metadata.max_num_logprobs is not None:
            source = raw_logprobs if raw_logprobs is not None else processed_logprobs
            logprobs_tensors = gather_logprobs(source, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled.to(torch.int32).unsqueeze(1), logprobs_tensors)

    forward = __call__

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        want_processed = metadata.max_num_logprobs is not None and self.logprobs_mode == "processed_logprobs"
        backend = backend_for_tensor(logits, self.backend)  # resolved once: every op below runs on it
        greedy = None if metadata.all_random else backend.argmax(logits)
        if metadata.all_greedy:
            return greedy, compute_logprobs(logits) if want_processed else None
        if metadata.temperature is None or metadata.temperature.shape != (logits.shape[0],):
            raise ValueError(f"metadata.temperature must have shape ({logits.shape[0]},) for a batch with random rows")
        # A backend that filters and draws in one go (CUDA's v2 sampling) reads the logits once,
        # dividing by the temperature as it reads when nothing else needs the tempered logits.
        fused = backend.fused_logit_sampling and not want_processed
        temper_in_kernel = fused and metadata.min_p is None and not metadata.logitsprocs.argmax_invariant
        if temper_in_kernel and (sampled := self._sample_fused(logits, metadata, backend, metadata.temperature)) is not None:
            return self._merge_greedy(sampled, greedy, metadata), None
        ops.apply_temperature(logits, metadata.temperature, all_random=metadata.all_random)
        if metadata.min_p is not None:
            logits = ops.apply_min_p(logits, metadata.min_p)
        for processor in metadata.logitsprocs.argmax_invariant:
            logits = processor.apply(logits)
        if fused and not temper_in_kernel and (sampled := self._sample_fused(logits, metadata, backend, None)) is not None:
            return self._merge_greedy(sampled, greedy, metadata), None
        # A row with a NaN, a +inf or nothing left above -inf has no distribution: it is sampled as
        # its fallback token on every backend (backends/sampling_rules.py), and the filters below must
        # not decide what it becomes.
        undefined, fallback = ops.undefined_row_fallback(logits, backend=backend)
        logits, probs = ops.top_k_top_p_probs(logits, metadata.top_k, metadata.top_p, max_top_k=metadata.max_top_k, backend=backend)
        processed = compute_logprobs(logits) if want_processed else None
        sampled = ops.random_sample(probs, metadata.generators, backend=backend, noise=metadata.noise)
        if fallback is not None:
            sampled = torch.where(undefined, fallback, sampled)
        return self._merge_greedy(sampled, greedy, metadata), processed

    @staticmethod
    def _sample_fused(logits, metadata: SamplingMetadata, backend: Backend, temperature) -> torch.Tensor | None:
        return ops.sample_from_logits(
            logits, temperature, metadata.top_k, metadata.top_p, metadata.generators, max_top_k=metadata.max_random_top_k,
            backend=backend, noise=metadata.noise, all_random=metadata.all_random,
        )

    @staticmethod
    def _merge_greedy(sampled: torch.Tensor, greedy: torch.Tensor | None, metadata: SamplingMetadata) -> torch.Tensor:
        if greedy is None:
            return sampled
        return torch.where(metadata.temperature < SAMPLING_EPS, greedy, sampled)


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """The sampled token's log-probability and rank, then the top `num_logprobs` per row."""
    top_values, top_indices = logprobs.topk(num_logprobs, dim=-1)
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    return LogprobsTensors(
        torch.cat((token_ids, top_indices), dim=1).to(torch.int32),
        torch.cat((token_logprobs, top_values), dim=1),
        ranks,
    )
