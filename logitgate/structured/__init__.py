"""Constraints -> per-row allowed sets and bitmasks."""
from .bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask_inplace,
    bitmask_from_token_ids,
    fill_bitmask_row,
    get_bitmask_shape,
    reset_token_bitmask,
    token_ids_from_bitmask,
)
from .grammar import BaseGrammarBackend, Grammar, GrammarBackend
from .manager import RequestStatus, StructuredOutputManager
from .params import StructuredOutputsParams
from .registry import available_grammar_backends, get_grammar_backend_factory, register_grammar_backend
from .speculative import apply_grammar_bitmask, grammar_bitmask_rows, strip_speculative_padding
from .tree import TreeDFA

__all__ = [
    "BaseGrammarBackend",
    "Grammar",
    "GrammarBackend",
    "RequestStatus",
    "StructuredOutputManager",
    "StructuredOutputsParams",
    "TreeDFA",
    "allocate_token_bitmask",
    "apply_grammar_bitmask",
    "apply_token_bitmask_inplace",
    "available_grammar_backends",
    "bitmask_from_token_ids",
    "fill_bitmask_row",
    "get_bitmask_shape",
    "get_grammar_backend_factory",
    "grammar_bitmask_rows",
    "register_grammar_backend",
    "reset_token_bitmask",
    "strip_speculative_padding",
    "token_ids_from_bitmask",
]
