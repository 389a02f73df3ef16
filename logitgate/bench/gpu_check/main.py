"""The GPU check's run: arguments, then each step in turn within the budget (docs/gpu-check.md)."""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import __doc__ as CHECK_DOC
from .bitmask import bench_bitmask
from .config import GOAL_COPY_FRACTION, GOAL_FLOOR_RATIO, REPO, SHAPES
from .probe import environment
from .rejection import bench_rejection
from .report import variants_json, write_report
from .sampling import SAMPLING_CASES, bench_sampling
from .suite import run_tests
from .sync import overlap_check, sync_check
from .timing import Timer
from .tree import bench_tree
from .wheels import DEFAULT_WHEELS, ensure_packages


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=CHECK_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda, or cpu for the dry run")
    parser.add_argument("--out", default=None, help="results folder (default: gpu-check-out/<UTC time>-<device>)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per implementation (default 50; 15 quick; 5 on cpu)")
    parser.add_argument("--budget-s", type=float, default=600.0, help="the whole run's time limit; the tests get what is left")
    parser.add_argument("--wheels", default=str(DEFAULT_WHEELS), help="folder of wheels for missing packages (pip --no-index)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--pytest-args", default=None, help='arguments for pytest (default on cuda: "-q tests")')
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 3:
        parser.error("--repeats must be at least 3 (a median and a spread need several runs)")
    if args.budget_s <= 0:
        parser.error("--budget-s must be positive")
    if args.out is None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        args.out = str(REPO / "gpu-check-out" / f"{stamp}-{args.device}")
    return args


BENCHMARKS = {"bitmask": bench_bitmask, "sampling": bench_sampling, "rejection": bench_rejection, "tree": bench_tree}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    out = Path(args.out)
    packages = ensure_packages(args.wheels)
    import torch

    from logitgate.backends import get_backend, probe_cuda

    from ..harness import Progress

    if args.device == "cuda":
        probe = probe_cuda()
        if not probe.available:
            print(f"gpu_check: CUDA is unusable here ({probe.reason}); `--device cpu` is the dry run", file=sys.stderr)
            return 2
        if os.environ.get("TRITON_INTERPRET") == "1":
            print("gpu_check: TRITON_INTERPRET=1 is set; the GPU check measures native Triton: unset it", file=sys.stderr)
            return 2
    backend = get_backend(args.device)
    shapes = SHAPES[args.device]
    repeats = args.repeats or (5 if args.device == "cpu" else 15 if args.quick else 50)
    report: dict[str, Any] = {
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "environment": {**environment(args.device), "packages": packages},
        "timing": ("CUDA events, L2 flushed before each run" if args.device == "cuda" else "perf_counter (CPU dry run)")
        + f", median of {repeats} interleaved runs",
        "shapes": shapes,
        "goals": {"bitmask_fraction_of_copy": GOAL_COPY_FRACTION, "bitmask_vs_xgrammar": ">= 1x at every shape",
                  "sampling_and_rejection_vs_one_read_floor": GOAL_FLOOR_RATIO, "host_syncs_per_step": 0},
    }
    # bitmask: one step per shape and dtype, and the grammar-like mask; sampling: one per case
    bench_steps = 2 * len(shapes["bitmask"]) + 1 + len(SAMPLING_CASES) + len(BENCHMARKS) - 2
    steps = 2 + (0 if args.skip_bench else bench_steps) + (0 if args.skip_tests else 1)
    progress = Progress(steps, "gpu-check")
    write_report(report, out)
    print(f"gpu_check: results in {out}", file=sys.stderr)

    progress.step("sync check: one decode step under set_sync_debug_mode('error')")
    report["sync_check"] = _guarded(lambda: sync_check(backend, shapes))
    progress.step("side-stream overlap (CUDA events)")
    report["overlap_check"] = _guarded(lambda: overlap_check(backend, shapes))
    write_report(report, out)

    if not args.skip_bench:
        report["benchmarks"] = {"errors": {}}
        timer = Timer(args.device)
        for name, fn in BENCHMARKS.items():
            try:
                report["benchmarks"][name] = fn(backend, shapes, timer, repeats, progress)
            except Exception as exc:  # noqa: BLE001 - one failing benchmark must not lose the others
                report["benchmarks"]["errors"][name] = f"{type(exc).__name__}: {exc}"
            write_report(report, out)
        report["variants"] = variants_json(report["benchmarks"])
        write_report(report, out)
        if args.device == "cuda":
            torch.cuda.synchronize()

    if not args.skip_tests:
        progress.step("test suite (LOGITGATE_DEVICE=%s, native Triton)" % args.device)
        if args.pytest_args is None and args.device == "cpu":
            report["tests"] = {"skipped_reason": "CPU dry run without --pytest-args (`make test` runs the suite on CPU)"}
        else:
            pytest_args = shlex.split(args.pytest_args) if args.pytest_args is not None else ["-q", "tests"]
            left = args.budget_s - (time.perf_counter() - started) - 15
            if left < 30:
                report["tests"] = {"skipped_reason": f"only {left:.0f} s of the {args.budget_s:.0f} s budget left"}
            else:
                report["tests"] = run_tests(args.device, pytest_args, out, left)
    else:
        report["tests"] = {"skipped_reason": "--skip-tests"}

    report["seconds"] = round(time.perf_counter() - started, 1)
    report["passed"] = all([
        report["sync_check"].get("passed", False),
        report["overlap_check"].get("passed", False),
        not report.get("benchmarks", {}).get("errors"),
        "skipped_reason" in report["tests"] or report["tests"].get("passed_all", False),
    ])
    write_report(report, out)
    print((out / "gpu_check.md").read_text())
    print(f"gpu_check: {'PASS' if report['passed'] else 'FAIL'}; JSON and markdown in {out}", file=sys.stderr)
    return 0 if report["passed"] else 1


def _guarded(fn: Callable[[], dict]) -> dict:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        return {"checked": False, "passed": False, "error": f"{type(exc).__name__}: {exc}"}
