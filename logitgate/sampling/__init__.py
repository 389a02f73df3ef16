"""Sampling: parameters, the per-step sampler, sampling ops, logits processors, and the rejection
sampler that verifies speculative drafts.

Names load on first use (logitgate/lazy.py): `from logitgate.sampling.params import SAMPLING_EPS`
loads the parameters alone, not torch and the kernels behind the sampler."""
from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS = {
    "apply_min_p": ".ops",
    "apply_sampling_constraints": ".ops",
    "apply_temperature": ".ops",
    "apply_top_k_top_p": ".ops",
    "draw_sampling_noise": ".ops",
    "random_sample": ".ops",
    "SAMPLING_EPS": ".params",
    "SamplingParams": ".params",
    "SamplingType": ".params",
    "StructuredOutputsParams": ".params",
    "LogprobsTensors": ".sampler",
    "Sampler": ".sampler",
    "SamplerOutput": ".sampler",
    "SamplingMetadata": ".sampler",
    "make_generator": ".sampler",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
