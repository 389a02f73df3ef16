"""How many threads logitgate's CPU kernels (numba) and the demo use when nobody says.

All cores is the libraries' default, and it falls off a cliff on a shared host: a parallel region
waits at its barrier for every thread, so when another process holds a core, the region waits for
a time slice (4-8 ms). Issue 15 measured, on a loaded 2-core host, bitmask apply at 8-9 ms with 2
threads and 0.85 ms with 1, `demo --quick` at 23 s and 0.55 s; logitgate/bench/threads.py measures it
on any host (docs/devices.md, "Threads"). The default is therefore the cores that are idle when it is first
asked for: usable cores minus the 1-minute load average, rounded, at least 1.
`LOGITGATE_THREADS=N` overrides it.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from ... import envs
from ...cores import usable_cores

__all__ = ["safe_thread_count", "set_thread_cap", "thread_cap", "usable_cores"]

ENV_THREADS = "LOGITGATE_THREADS"


def safe_thread_count(cores: int | None = None, load: float | None = None) -> int:
    """LOGITGATE_THREADS if set, else the idle cores: round(cores - load), clamped to [1, cores]."""
    value = envs.read(ENV_THREADS)
    if value:
        try:
            threads = int(value)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(f"{ENV_THREADS}={value!r}: expected a positive integer")
        return threads
    cores = cores or usable_cores()
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # no load average (Windows): trust the cores
            load = 0.0
    return max(1, min(cores, round(cores - load)))


_cap: int | None = None  # None: not decided yet (safe_thread_count on first use)


def thread_cap() -> int:
    """The most numba threads a CPU kernel uses, decided on first use."""
    global _cap
    if _cap is None:
        _cap = safe_thread_count()
    return _cap


def set_thread_cap(threads: int | None) -> None:
    """Let CPU kernels use up to `threads` numba threads (None: decide again on next use). The
    demo's and the benchmarks' --threads call this, so an explicit choice is never capped."""
    global _cap
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads}")
    _cap = threads


@contextlib.contextmanager
def numba_thread_cap(threads: int) -> Iterator[None]:
    """Run numba's parallel kernels with at most `threads` threads (a lower setting of the caller's
    numba.set_num_threads wins); restored afterwards. numba's setting is per calling thread."""
    import numba

    current = numba.get_num_threads()
    if current <= threads:
        yield
        return
    numba.set_num_threads(threads)
    try:
        yield
    finally:
        numba.set_num_threads(current)
