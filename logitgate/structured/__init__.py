"""Constraints -> per-row allowed sets and bitmasks.

The names are loaded on first use (PEP 562), as `logitgate`'s are: the import-light modules of
this layer (`structured.tree.limits`, `structured.params`) are imported by vLLM's plugin and front
end at start-up, which must not pull in torch or numba (see docs/design.md)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS = {
    "allocate_token_bitmask": ".bitmask",
    "apply_token_bitmask_inplace": ".bitmask",
    "bitmask_from_token_ids": ".bitmask",
    "fill_bitmask_row": ".bitmask",
    "get_bitmask_shape": ".bitmask",
    "reset_token_bitmask": ".bitmask",
    "token_ids_from_bitmask": ".bitmask",
    "BaseGrammarBackend": ".grammar",
    "Grammar": ".grammar",
    "GrammarBackend": ".grammar",
    "RequestStatus": ".manager",
    "StructuredOutputManager": ".manager",
    "StructuredOutputsParams": ".params",
    "available_grammar_backends": ".registry",
    "get_grammar_backend_factory": ".registry",
    "register_grammar_backend": ".registry",
    "apply_grammar_bitmask": ".speculative",
    "grammar_bitmask_rows": ".speculative",
    "strip_speculative_padding": ".speculative",
    "TreeDFA": ".tree.dfa",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:
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
    from .tree.dfa import TreeDFA
