"""Timing on the device: CUDA events with L2 flushed (perf_counter on the CPU), interleaved runs,
CUDA kernel variants timed side by side, and a row judged against the one-read floor."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .config import GOAL_FLOOR_RATIO


class Timer:
    """Seconds of one run of fn: CUDA events around it (L2 flushed first, so a 30 MB operand is not
    served from a 50 MB cache), or perf_counter on the CPU. `fn` may be (setup, fn): setup runs
    untimed before each run (restoring inputs that fn modifies)."""

    def __init__(self, device: str) -> None:
        import torch

        self.device = device
        self.cuda = device == "cuda"
        if self.cuda:
            self._flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn: Callable[[], Any] | tuple[Callable[[], Any], Callable[[], Any]]) -> float:
        import torch

        setup, run = fn if isinstance(fn, tuple) else (None, fn)
        if setup:
            setup()
        if not self.cuda:
            start = time.perf_counter()
            run()
            return time.perf_counter() - start
        self._flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def warm(self, fn) -> None:
        setup, run = fn if isinstance(fn, tuple) else (None, fn)
        if setup:
            setup()
        run()


def timed(fns: dict[str, Any], timer: Timer, repeats: int) -> dict[str, Any]:
    """Interleaved runs of every implementation (round robin), after one warm-up run each."""
    from ..harness import round_robin

    for fn in fns.values():
        timer.warm(fn)
    return round_robin(fns, repeats, timer=timer)


def in_variant(op: str, variant: str, fn):
    """fn (or (setup, fn)) run with LOGITGATE_CUDA_KERNELS selecting `variant` for `op` (the
    variable is read at every call, so variants interleave in one process under the same timer)."""
    from logitgate.backends.variants import selected

    setup, run = fn if isinstance(fn, tuple) else (None, fn)

    def selected_run():
        with selected(op, variant):
            return run()

    return (setup, selected_run) if setup else selected_run


def variant_summary(runs: dict, correct: dict | None = None) -> dict[str, Any]:
    """current vs v2 from interleaved runs named "logitgate" (current) and "logitgate_v2"."""
    current, v2 = runs["logitgate"].median, runs["logitgate_v2"].median
    summary = {"current_us": current * 1e6, "v2_us": v2 * 1e6, "speedup_v2": current / v2,
               "faster": "v2" if v2 < current else "current"}
    if correct is not None:
        summary["correct"] = {"current": correct.get("logitgate"), "v2": correct.get("logitgate_v2")}
    return summary


def us_fields(timing) -> dict[str, float]:
    return {"us": timing.median * 1e6, "us_min": min(timing.runs) * 1e6, "us_max": max(timing.runs) * 1e6,
            "spread": timing.spread}


def floor_row(case: str, shape: str, runs: dict) -> dict:
    """A result row judged against the one-read floor: logitgate's time over the floor's (the
    goal), and the speedup over every other baseline timed in `runs`."""
    ours = runs["logitgate"].median
    row = {"case": case, "shape": shape, "impl": {name: us_fields(t) for name, t in runs.items()},
           "vs_one_read_floor": ours / runs["one_read_floor"].median}
    row.update({f"speedup_vs_{name}": t.median / ours for name, t in runs.items()
                if name not in ("logitgate", "logitgate_v2", "one_read_floor")})
    if "logitgate_v2" in runs:
        row["vs_one_read_floor_v2"] = runs["logitgate_v2"].median / runs["one_read_floor"].median
    row["goal_met"] = min(row["vs_one_read_floor"], row.get("vs_one_read_floor_v2", float("inf"))) <= GOAL_FLOOR_RATIO
    return row
