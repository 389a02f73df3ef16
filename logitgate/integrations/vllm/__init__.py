"""logitgate inside vLLM: the tree-decode logits processor (vLLM v1's batch-level interface)."""
from .logits_processor import FQCN, VLLM_AVAILABLE, TreeDecodeLogitsProcessor

__all__ = ["FQCN", "VLLM_AVAILABLE", "TreeDecodeLogitsProcessor"]
