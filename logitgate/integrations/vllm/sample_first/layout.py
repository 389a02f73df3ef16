"""Where `sample_first` can run: engines with one CPU worker (and no drafter but one that proposes
from tokens), runners that carry the worker-side replacements, and the runners that sampled in this
process (vLLM's in-process executor)."""
from __future__ import annotations

import weakref
from typing import Any

from ..patching import is_replacement

__all__ = ["TOKEN_DRAFTERS", "one_cpu_worker", "runner_handles_deferred", "runners", "why_not_one_cpu_worker"]

# vLLM's drafters that propose from the tokens alone (vLLM's `method` names): a step leaves requests
# they found nothing for without drafts, whose one row is free to sample first. Drafters that read
# the model (EAGLE, MTP, Medusa, draft models) draft every request every step.
TOKEN_DRAFTERS = ("ngram", "suffix")
runners: "weakref.WeakSet[Any]" = weakref.WeakSet()  # model runners that sampled in this process


def runner_handles_deferred(runner: Any) -> bool:
    """A runner whose class still carries both worker-side replacements and whose sampler keeps
    the processed logits: it will see, check and redraw deferred rows."""
    cls = type(runner)
    return is_replacement(cls.sample_tokens) and is_replacement(cls._sample) and is_replacement(getattr(type(getattr(runner, "sampler", None)), "sample", None))


def why_not_one_cpu_worker(config: Any) -> str | None:
    """None in the layouts where the one worker that samples a batch is the one the scheduler
    talks to (the CPU, world size 1, no async scheduling) and any drafter proposes from tokens
    (TOKEN_DRAFTERS: the rows of requests it found nothing for sample first; its drafts' rows are
    filled); else what rules sample_first out."""
    device = getattr(config.device_config, "device_type", None)
    if device != "cpu":
        return f"the device is {device}, not the CPU"
    if config.parallel_config.world_size != 1:
        return f"world size {config.parallel_config.world_size} (tensor / pipeline parallel)"
    if config.num_speculative_tokens:
        method = getattr(getattr(config, "speculative_config", None), "method", None)
        if method not in TOKEN_DRAFTERS:
            return (f"speculative decoding with the {method or 'configured'} drafter (it drafts every request every "
                    "step, and draft rows are masked before verification)")
    if getattr(getattr(config, "scheduler_config", None), "async_scheduling", False):
        return "async scheduling"
    return None


def one_cpu_worker(config: Any) -> bool:
    return why_not_one_cpu_worker(config) is None

