"""logitgate inside vLLM.

- `plugin.register`: the general plugin (entry point `vllm.general_plugins` -> `logitgate`): tree
  requests through vLLM's structured outputs (tree_route.py), vLLM's kernels on logitgate's backend.
- `TreeDecodeLogitsProcessor` (vLLM v1 model runner) and `TreeDecodeLogitsProcessorV2` (Model Runner
  V2), and `TreeDecode`, one name both runners load: tree decode as a custom logits processor.

Names load on first use: vLLM imports this package at start-up, when numba must not be loaded."""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FQCN": ".logits_processor",
    "VLLM_AVAILABLE": ".logits_processor",
    "TreeDecodeLogitsProcessor": ".logits_processor",
    "TreeDecodeLogitsProcessorV2": ".logits_processor_v2",
    "TreeDecode": ".logits_processor_v2",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
