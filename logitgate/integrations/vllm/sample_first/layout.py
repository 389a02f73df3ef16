"""Where `sample_first` can run: engines with one CPU worker, runners that carry the worker-side
replacements, and the runners that sampled in this process (vLLM's in-process executor)."""
from __future__ import annotations

import weakref
from typing import Any

from ..patching import is_replacement

__all__ = ["one_cpu_worker", "runner_handles_deferred", "runners", "why_not_one_cpu_worker"]

runners: "weakref.WeakSet[Any]" = weakref.WeakSet()  # model runners that sampled in this process


def runner_handles_deferred(runner: Any) -> bool:
    """A runner whose class still carries both worker-side replacements and whose sampler keeps
    the processed logits: it will see, check and redraw deferred rows."""
    cls = type(runner)
    return is_replacement(cls.sample_tokens) and is_replacement(cls._sample) and is_replacement(getattr(type(getattr(runner, "sampler", None)), "sample", None))


def why_not_one_cpu_worker(config: Any) -> str | None:
    """None in the layouts where the one worker that samples a batch is the one the scheduler
    talks to and no draft rows exist (the CPU, world size 1, no speculative decoding, no async
    scheduling); else what rules sample_first out."""
    device = getattr(config.device_config, "device_type", None)
    if device != "cpu":
        return f"the device is {device}, not the CPU"
    if config.parallel_config.world_size != 1:
        return f"world size {config.parallel_config.world_size} (tensor / pipeline parallel)"
    if config.num_speculative_tokens:
        return "speculative decoding (draft rows are masked before verification)"
    if getattr(getattr(config, "scheduler_config", None), "async_scheduling", False):
        return "async scheduling"
    return None


def one_cpu_worker(config: Any) -> bool:
    return why_not_one_cpu_worker(config) is None

