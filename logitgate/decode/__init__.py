"""The reference batched decode loop: `generate` over a model callable, with constraints, sampling and
speculative decoding (its per-sequence constraint state is structured/constraint_state.py)."""
from .generate import GenerationResult, GenerationStats, Request, generate

__all__ = ["GenerationResult", "GenerationStats", "Request", "generate"]
