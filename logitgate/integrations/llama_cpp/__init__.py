"""logitgate in llama.cpp (llama-cpp-python): trees and grammars as a logits processor, skip-ahead
generation and constrained prompt-lookup drafts. See docs/llama_cpp.md.

- `constrain(llm, strings=... | token_trie=... | prefix_dict=... | json=... | regex=... | grammar=...,
  mode="greedy" | "sampled", marker=None)` -> `LlamaConstraint`; pass
  `logits_processor=constraint.processors()` to `Llama.create_completion` /
  `create_chat_completion` (a new list per call: the processor holds the generation's state).
- `generate(llm, prompt, constraint, ...)`: the skip-ahead loop (forced tokens in one batch).
- `TreeDrafts(LlamaPromptLookupDecoding(...))`: `Llama(draft_model=...)` under a constraint.
"""
from .constraint import LlamaConstraint, constrain
from .drafts import TreeDrafts
from .gbnf import gbnf_for_sequences, gbnf_for_strings
from .processor import LlamaLogitsProcessor
from .skip_ahead import SkipAheadResult, generate

__all__ = [
    "LlamaConstraint",
    "LlamaLogitsProcessor",
    "SkipAheadResult",
    "TreeDrafts",
    "constrain",
    "gbnf_for_sequences",
    "gbnf_for_strings",
    "generate",
]
