"""logitgate: the layer between a model's logits and its next tokens — constraints, sampling and
speculative-decoding verification with one API on CUDA, Ascend NPU and CPU."""
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
from .structured.tree import TreeDFA

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "Capabilities",
    "Sampler",
    "SamplingMetadata",
    "SamplingParams",
    "StructuredOutputManager",
    "StructuredOutputsParams",
    "TreeDFA",
    "__version__",
    "allocate_token_bitmask",
    "apply_grammar_bitmask",
    "apply_token_bitmask_inplace",
    "bitmask_from_token_ids",
    "fill_bitmask_row",
    "get_bitmask_shape",
    "get_backend",
    "reset_token_bitmask",
    "strip_speculative_padding",
    "token_ids_from_bitmask",
]
