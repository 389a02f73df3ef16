"""Device detection that survives broken hosts.

Importing torch_npu on a machine without CANN raises (libhccl.so / libascendcl.so not found) or
even calls sys.exit; detection catches all of that, keeps the reason for `logitgate doctor`, and
warns once when an installed torch_npu could not be used.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
import warnings
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    """Whether a device kind is usable here, and if not, why."""

    available: bool
    reason: str
    count: int = 0


@functools.lru_cache(maxsize=None)
def probe_cuda() -> Probe:
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return Probe(False, f"torch {torch.__version__} is built without CUDA")
    if not torch.cuda.is_available():
        return Probe(False, "torch has CUDA, but no CUDA device is visible")
    count = torch.cuda.device_count()
    return Probe(True, f"{count} device(s): {torch.cuda.get_device_name(0)}", count)


@functools.lru_cache(maxsize=None)
def probe_npu() -> Probe:
    if importlib.util.find_spec("torch_npu") is None:
        return Probe(False, "torch_npu is not installed")
    try:
        importlib.import_module("torch_npu")
    except (Exception, SystemExit) as exc:  # ImportError/OSError without CANN; some builds sys.exit()
        sys.modules.pop("torch_npu", None)
        reason = f"importing torch_npu failed: {type(exc).__name__}: {exc}"
        warnings.warn(f"logitgate: NPU unusable, falling back ({reason})", RuntimeWarning, stacklevel=2)
        return Probe(False, reason)
    npu = getattr(torch, "npu", None)
    try:
        if npu is None or not npu.is_available():
            return Probe(False, "torch_npu imported, but no NPU device is available")
        return Probe(True, f"{npu.device_count()} device(s)", npu.device_count())
    except Exception as exc:
        reason = f"torch.npu.is_available() failed: {type(exc).__name__}: {exc}"
        warnings.warn(f"logitgate: NPU unusable, falling back ({reason})", RuntimeWarning, stacklevel=2)
        return Probe(False, reason)


def reset_probes() -> None:
    """Forget cached probe results (tests, or after installing a driver in-process)."""
    probe_cuda.cache_clear()
    probe_npu.cache_clear()
