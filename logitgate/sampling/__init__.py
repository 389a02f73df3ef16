"""Sampling: parameters, the per-step sampler, sampling ops, logits processors, and the rejection
sampler that verifies speculative drafts."""
from .ops import (
    apply_min_p,
    apply_sampling_constraints,
    apply_temperature,
    apply_top_k_top_p,
    draw_sampling_noise,
    random_sample,
)
from .params import SAMPLING_EPS, SamplingParams, SamplingType, StructuredOutputsParams
from .sampler import LogprobsTensors, Sampler, SamplerOutput, SamplingMetadata, make_generator

__all__ = [
    "SAMPLING_EPS",
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingParams",
    "SamplingType",
    "StructuredOutputsParams",
    "apply_min_p",
    "apply_sampling_constraints",
    "apply_temperature",
    "apply_top_k_top_p",
    "draw_sampling_noise",
    "make_generator",
    "random_sample",
]
