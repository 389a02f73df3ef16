"""logitgate inside vLLM, by what each part takes over:

- plugin.py: the general plugin (entry point `vllm.general_plugins` -> `logitgate`) and `install`,
  the one door: every change to vLLM is a row of the patch table (patches.py; the mechanism:
  patching.py), grouped by the operation (LOGITGATE_VLLM_OPS) that selects it:
  - kernel_replacements.py: `bitmask`, `sampler`, `rejection` (vLLM's kernels on logitgate's);
  - fill_ahead.py: `fill` (the scheduler's bitmask filled while the model runs, on every core);
  - sample_first/: `sample_first` (rows sampled before their masks, per row and per step);
  - tree/: `tree` (tree requests through vLLM's structured outputs) and the admission every process
    needs;
- metrics.py: logitgate's counters in vLLM's /metrics;
- tree/logits_processor.py and logits_processor_v2.py: `TreeDecodeLogitsProcessor` (vLLM v1 model
  runner), `TreeDecodeLogitsProcessorV2` (Model Runner V2) and `TreeDecode`, one name both runners
  load: tree decode as a custom logits processor, where the `tree` route is not used.

Names load on first use: vLLM imports this package at start-up, when numba must not be loaded."""
from __future__ import annotations

from ...lazy import lazy_exports

_EXPORTS = {
    "FQCN": ".tree.logits_processor",
    "VLLM_AVAILABLE": ".tree.logits_processor",
    "TreeDecodeLogitsProcessor": ".tree.logits_processor",
    "TreeDecodeLogitsProcessorV2": ".tree.logits_processor_v2",
    "TreeDecode": ".tree.logits_processor_v2",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
