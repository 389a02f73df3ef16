"""The threads grammar-bitmask fills run on, one home for every operation that fills: fill_ahead.py
sizes vLLM's parallel fill by the usable cores (logitgate/cores.py); sample_first's worker fills a rejected row's mask on
`fill_pool()` (sample_first/redraw.py). xgrammar's and llguidance's fills release the GIL, so fills
of different requests run in parallel.

Imports nothing but the standard library: fill_ahead.py, which uses it, is loaded at vLLM start-up.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ...cores import usable_cores

__all__ = ["fill_pool"]

_fill_pool: ThreadPoolExecutor | None = None


def fill_pool() -> ThreadPoolExecutor:
    """The process's pool for fills outside vLLM's manager (sample_first's worker, for rejected rows),
    kept for the life of the process (the manager's own pool is vLLM's, shut down with it)."""
    global _fill_pool
    if _fill_pool is None:
        _fill_pool = ThreadPoolExecutor(usable_cores(), thread_name_prefix="logitgate-fill")
    return _fill_pool
