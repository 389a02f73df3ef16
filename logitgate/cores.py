"""How many cores this process may use: one answer for the CPU kernels' threads
(backends/cpu/threads.py) and the vLLM plugin's grammar fills (integrations/vllm/fill_threads.py).
Standard library only: the plugin loads it at vLLM start-up, when numba must not be loaded."""
from __future__ import annotations

import os

__all__ = ["usable_cores"]


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else the machine's count, at least 1."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
