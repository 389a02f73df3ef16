"""Threads on this host, now: logitgate's CPU kernels and the demo with 1 thread vs all cores vs the
default logitgate picks (logitgate.backends.cpu.threads.safe_thread_count: the idle cores), in
interleaved runs, with the load average before and after. On a shared host the all-cores runs wait
for descheduled threads at every parallel barrier; this script is the evidence for the defaults.

    python -m logitgate.bench.threads [--quick] [--repeats N] [--demo-runs N] [--out FILE] [--plot FILE.png]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numba
import torch

import logitgate
from logitgate.backends.cpu.threads import safe_thread_count, set_thread_cap, usable_cores
from logitgate.backends.formats import pack_bitmask
from logitgate.bench.harness import Progress, Timing, emit, plot_bars, round_robin


def with_threads(fn, threads: int):
    def run():
        numba.set_num_threads(threads)
        torch.set_num_threads(threads)
        set_thread_cap(threads)
        fn()

    return run


def bench_bitmask(thread_counts: dict[str, int], repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 128256, generator=g)
    bitmask = pack_bitmask(torch.rand(64, 128256, generator=g) < 0.5)
    cpu = logitgate.get_backend("cpu")
    apply = lambda: logitgate.apply_token_bitmask_inplace(logits, bitmask, backend=cpu)  # noqa: E731
    runs = round_robin({name: with_threads(apply, n) for name, n in thread_counts.items()}, repeats)
    return _row("bitmask apply 64x128256 fp32, 50% allowed", runs)


def demo_seconds(threads: int) -> float:
    """Wall time of `logitgate demo --quick --json --threads N` in a fresh process."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "logitgate", "demo", "--quick", "--json", "--threads", str(threads)],
                   check=True, capture_output=True)
    return time.perf_counter() - start


def bench_demo(thread_counts: dict[str, int], runs: int) -> dict:
    times: dict[str, list[float]] = {name: [] for name in thread_counts}
    for _ in range(runs):
        for name, n in thread_counts.items():
            times[name].append(demo_seconds(n))
    return _row("demo --quick (fresh process, wall)", {name: Timing(tuple(t)) for name, t in times.items()})


def _row(case: str, runs: dict[str, Timing]) -> dict:
    row = {"case": case}
    for name, timing in runs.items():
        row.update(timing.fields(name))
    row["all_cores_ratio"] = runs["all_cores"].median / runs["one_thread"].median  # all cores' time / 1 thread's
    row["default_ratio"] = runs["default"].median / runs["one_thread"].median
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, one demo run per setting")
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--demo-runs", type=int, default=3)
    parser.add_argument("--out")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    thread_counts = {"one_thread": 1, "all_cores": usable_cores(), "default": safe_thread_count()}
    progress = Progress(2, "threads")
    progress.step(f"bitmask apply, threads {thread_counts}")
    rows = [bench_bitmask(thread_counts, 11 if args.quick else args.repeats)]
    progress.step("demo --quick in fresh processes")
    rows.append(bench_demo(thread_counts, 1 if args.quick else args.demo_runs))
    result = {
        "benchmark": "threads",
        "cores": usable_cores(),
        "threads": thread_counts,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "note": "*_ratio: that setting's median time / one thread's (above 1: slower than one thread)",
        "rows": rows,
    }
    emit(result, args.out)
    if args.plot:
        plot_bars(rows, "case", ["one_thread", "all_cores", "default"], "1 thread vs all cores vs logitgate's default",
                  args.plot, subtitle=f"threads: all cores {thread_counts['all_cores']}, default {thread_counts['default']}; "
                  f"load average {load_before[0]:.1f} at the start")
    return result


if __name__ == "__main__":
    main()
