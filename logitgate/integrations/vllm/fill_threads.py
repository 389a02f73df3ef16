"""Threads for grammar-bitmask fills in a vLLM process: xgrammar's fill releases the GIL, so
fills of different requests run in parallel. `cores()` sizes the scheduler manager's pool
(fill_ahead.py, which vLLM shuts down with the manager); `pool()` serves the worker's fills of
rejected rows (sample_first/redraw.py) for the life of the process."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

__all__ = ["cores", "pool"]

_pool: ThreadPoolExecutor | None = None


def cores() -> int:
    # backends/cpu/threads.usable_cores, which cannot be imported here: its package loads numba,
    # and this module is loaded at vLLM start-up.
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(cores(), thread_name_prefix="logitgate-fill")
    return _pool
