"""Hugging Face transformers integration, the public name (`logitgate.integrations.transformers`):
the code lives in hf/ (processors.py, speculative.py); docs/huggingface.md is the guide."""
from __future__ import annotations

from .hf.processors import GrammarLogitsProcessor, TreeLogitsProcessor, tree_generation_kwargs
from .hf.speculative import SpeculativeOutput, speculative_generate

__all__ = ["GrammarLogitsProcessor", "SpeculativeOutput", "TreeLogitsProcessor", "speculative_generate", "tree_generation_kwargs"]
