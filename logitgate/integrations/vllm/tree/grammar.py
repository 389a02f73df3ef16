"""A tree as one of vLLM's structured-output grammars.

vLLM's StructuredOutputManager already does what tree decode needs under speculative decoding: it
drops drafts the grammar rejects before they are verified (`validate_tokens`), builds one bitmask
row per draft position plus the bonus row by advancing through the drafts and rolling back, and
advances the grammar by the tokens the rejection sampler accepted. Serving tree requests through
it (rather than through a logits processor, which vLLM does not load with speculative decoding)
makes the tree hold with and without drafts, on every model runner.

The walk itself is logitgate's `TreeGrammar` (a TreeCursor, structured/tree/cursor.py); this module only speaks
vLLM's interface. Imported by the engine when the first tree request arrives, never at start-up.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.backend_types import StructuredOutputGrammar
from vllm.v1.structured_output.request import StructuredOutputRequest

from ....structured.tree.grammar_backend import TreeGrammar
from .compile import compile_tree

__all__ = ["TreeOutputGrammar", "TreeOutputRequest", "compile_tree_grammar"]

# What vLLM's logs and `structured_output_key` show for a tree request (never compiled by vLLM).
_TREE_PARAMS_LABEL = "logitgate tree decode"


class TreeOutputGrammar(StructuredOutputGrammar):
    """vLLM's StructuredOutputGrammar over one request's walk through a TreeDFA."""

    # sample_first leaves a tree's rows to the scheduler: their fill is a copy of one CSR row,
    # cheaper than the check (and the worker's mirror) that sampling first would need.
    samples_first = False

    def __init__(self, walk: TreeGrammar) -> None:
        self.walk = walk

    @property
    def tree(self) -> Any:
        return self.walk.tree

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return self.walk.accept_tokens(tokens)

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return self.walk.validate_tokens(tokens)

    def rollback(self, num_tokens: int) -> None:
        self.walk.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None:
        self.walk.fill_bitmask(bitmask, batch_index)

    def is_terminated(self) -> bool:
        return self.walk.is_terminated()

    def reset(self) -> None:
        self.walk.reset()


def compile_tree_grammar(tree_request: Any, vocab_size: int, eos_token_id: int | None) -> TreeOutputGrammar:
    """Compile (through TreeDFA's process-wide cache) on the host, where vLLM keeps its bitmask; a
    large tree parsed in the admission process (compile.py)."""
    return TreeOutputGrammar(TreeGrammar(compile_tree(tree_request, vocab_size, eos_token_id)))


class TreeOutputRequest(StructuredOutputRequest):
    """vLLM's per-request structured-output record for a tree request. `tree_request` is the
    resolved logitgate TreeRequest, or `error` the reason it cannot be served (the scheduler then
    fails that request alone)."""

    def __init__(self, tree_request: Any = None, error: Exception | None = None) -> None:
        super().__init__(params=StructuredOutputsParams(grammar=_TREE_PARAMS_LABEL))
        self.tree_request = tree_request
        self.error = error
