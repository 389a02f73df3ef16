"""Logits processors with vLLM v1's programming model: `update_state(BatchUpdate | None)` then
`apply(logits)`, argmax-invariant ones skipped for all-greedy batches, and
`apply_with_spec_decode` for target logits under speculative decoding."""
from .builtin import LogitBias, MinP, MinTokens, builtin_logits_processors
from .interface import AddedRequest, BatchUpdate, LogitsProcessor, MoveDirectionality, MovedRequest, RemovedRequest
from .multiseq import MultiSeq
from .spec_layout import SpecDecodeLayout
from .state import BatchUpdateBuilder, LogitsProcessors, process_dict_updates
from .thinkmode import ThinkMode
from .tree import Tree, TreeRequest, tree_request

__all__ = [
    "AddedRequest",
    "BatchUpdate",
    "BatchUpdateBuilder",
    "LogitBias",
    "LogitsProcessor",
    "LogitsProcessors",
    "MinP",
    "MinTokens",
    "MoveDirectionality",
    "MovedRequest",
    "MultiSeq",
    "RemovedRequest",
    "SpecDecodeLayout",
    "ThinkMode",
    "Tree",
    "TreeRequest",
    "builtin_logits_processors",
    "process_dict_updates",
    "tree_request",
]
