"""`logitgate bench`: run logitgate's benchmarks, one table per benchmark.

Each benchmark (a module of logitgate/bench/, `python -m logitgate.bench.NAME`) writes JSON
(`--out`) and a PNG (`--plot`); this command runs them in fresh processes (so a numba compile or a cache load is not charged to the next one), forwards their
progress lines (step, elapsed, ETA), and prints every case with its full name and four separate
columns: times (lower is better), speedups of logitgate (higher is better), logitgate's time over a
floor or baseline (lower is better) and the noise flag. The same tables go to summary.md.
`logitgate bench --gpu` runs the GPU check (logitgate/bench/gpu_check/) instead (see docs/gpu-check.md).
"""
from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ..bench import BENCHMARKS
from ..bench.harness import NOISY_SPREAD, impl_label, package_env
from .output_paths import make_output_folder

BENCH_PACKAGE = "logitgate.bench"  # the benchmarks run as `python -m logitgate.bench.NAME`
SPEEDUP_KEY = re.compile(r"(^|_)speedup(_|$)")  # speedup_vs_x, dense_speedup_vs_x: x's time / logitgate's
TIME_RATIO_KEY = re.compile(r"^vs_|_ratio$")  # vs_x, *_ratio: logitgate's time / x's time
CASE_KEYS = ("case", "threads", "op", "scenario", "shape", "dtype", "allowed", "mode", "batch", "vocab", "items", "k", "drafts")


def available() -> list[str]:
    return sorted(BENCHMARKS)


def discover(only: list[str] | None = None) -> list[str]:
    """The benchmarks to run: all of them, or those named in `only` (an empty list is an error
    that lists the names, not a silent full run)."""
    names = available()
    if only is not None and not only:
        raise ValueError(f"--only needs one or more benchmark names: {', '.join(names)}")
    unknown = [o for o in only or [] if o not in names]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(names)}")
    return only or names


@dataclass
class Case:
    """One benchmark row, split by direction so that no column mixes better-is-lower with
    better-is-higher numbers."""

    name: str
    times_ms: dict[str, float] = field(default_factory=dict)  # implementation -> median ms (lower is better)
    speedups: dict[str, float] = field(default_factory=dict)  # "vs x" -> x's time / logitgate's (higher is better)
    time_ratios: dict[str, float] = field(default_factory=dict)  # "vs x" -> logitgate's time / x's (lower is better)
    noisy: dict[str, float] = field(default_factory=dict)  # implementation -> IQR / median, when above NOISY_SPREAD


def _case_name(row: dict) -> str:
    labels = []
    for key in CASE_KEYS:
        if key not in row:
            continue
        value = row[key]
        if key == "allowed" and isinstance(value, float):
            value = f"{value:.0%}"
        labels.append(str(value) if key in ("case", "op", "scenario", "shape", "dtype") else f"{key}={value}")
    return " ".join(labels) or " ".join(str(v) for v in row.values() if isinstance(v, str))


def _ratio_label(key: str) -> str:
    key = re.sub(r"(^|_)speedup(_|$)", r"\1", key).removesuffix("_ratio")
    return key.replace("_", " ").strip()


def cases(result: dict) -> list[Case]:
    """Every row of a benchmark's JSON as a Case."""
    found = []
    for row in result.get("rows") or result.get("results") or []:
        case = Case(_case_name(row))
        for key, value in row.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if key.endswith("_ms"):
                case.times_ms[key.removesuffix("_ms")] = float(value)
            elif key.endswith("_spread") and value > NOISY_SPREAD:
                case.noisy[key.removesuffix("_spread")] = float(value)
            elif SPEEDUP_KEY.search(key):
                case.speedups[_ratio_label(key)] = float(value)
            elif TIME_RATIO_KEY.search(key):
                case.time_ratios[_ratio_label(key)] = float(value)
        found.append(case)
    return found


def child_env(device: str | None) -> dict[str, str]:
    """The benchmarks' environment: they import this same logitgate (not another installed copy)."""
    env = package_env()
    if device:
        env["LOGITGATE_DEVICE"] = device
    return env


def _forward_progress(proc: subprocess.Popen, prefix: str) -> list[str]:
    """Copy the child's progress lines to our stderr with `prefix`; return its last other lines."""
    tail: collections.deque[str] = collections.deque(maxlen=20)
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("[") and "] step " in line:
            sys.stderr.write(f"{prefix} {line}")
            sys.stderr.flush()
        else:
            tail.append(line.rstrip("\n"))
    proc.wait()
    return list(tail)


def run(out: str, only: list[str] | None = None, quick: bool = False, device: str | None = None) -> dict:
    names = discover(only)
    out_dir = make_output_folder(out)
    env = child_env(device)
    summary: dict[str, dict] = {}
    started = time.perf_counter()
    for i, name in enumerate(names):
        json_path, png_path = out_dir / f"{name}.json", out_dir / f"{name}.png"
        cmd = [sys.executable, "-m", f"{BENCH_PACKAGE}.{name}", "--out", str(json_path), "--plot", str(png_path)]
        if quick:
            cmd.append("--quick")
        sys.stderr.write(f"benchmark {i + 1}/{len(names)}: {name} ({time.perf_counter() - started:.0f}s so far)\n")
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        tail = _forward_progress(proc, f"  {i + 1}/{len(names)}")
        entry: dict = {"seconds": round(time.perf_counter() - start, 1), "json": str(json_path), "png": str(png_path)}
        if proc.returncode != 0:
            entry["error"] = next((line for line in reversed(tail) if line.strip()), f"exit {proc.returncode}")
        else:
            entry["cases"] = [vars(c) for c in cases(json.loads(json_path.read_text()))]
        summary[name] = entry
    sys.stderr.write(f"done in {time.perf_counter() - started:.0f}s\n")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "summary.md").write_text(format_table(summary, markdown=True) + "\n")
    return summary


def _join(values: dict[str, float], fmt: str, labels: bool = False) -> str:
    return ", ".join(f"{impl_label(k) if labels else k} {format(v, fmt)}" for k, v in values.items()) or "-"


def _time(v: float) -> str:
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


COLUMNS = (
    "case",
    "times, ms (lower is better)",
    "logitgate speedup, x (higher is better)",
    "logitgate time / other (lower is better)",
    f"noise (IQR > {NOISY_SPREAD:.0%} of median)",
)


def _cells(case: Case) -> list[str]:
    times = ", ".join(f"{impl_label(k)} {_time(v)}" for k, v in case.times_ms.items()) or "-"
    noise = ", ".join(f"NOISY {impl_label(k)} {v:.0%}" for k, v in case.noisy.items()) or "ok"
    return [case.name, times, _join(case.speedups, ".2f"), _join(case.time_ratios, ".2f"), noise]


def format_table(summary: dict, *, markdown: bool = False) -> str:
    """One table per benchmark; full case names; times, speedups and time ratios in separate columns."""
    blocks = []
    for name, entry in summary.items():
        if "error" in entry:
            blocks.append(f"{name}: FAILED: {entry['error']}")
            continue
        rows = [_cells(Case(**c) if isinstance(c, dict) else c) for c in entry["cases"]]
        if markdown:
            lines = [f"### {name}", "", "| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
            lines += ["| " + " | ".join(row) + " |" for row in rows]
        else:
            widths = [max(len(r[i]) for r in [list(COLUMNS), *rows]) for i in range(len(COLUMNS))]
            fmt = lambda r: "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()  # noqa: E731
            lines = [f"== {name} ({entry['seconds']} s) ==", fmt(list(COLUMNS)), "  ".join("-" * w for w in widths)]
            lines += [fmt(row) for row in rows]
        blocks.append("\n".join(lines))
    blocks.append(
        "speedup = the other implementation's median time / logitgate's (above 1: logitgate is faster); "
        "time / other = logitgate's median time / the floor's or baseline's (below 1: faster)."
    )
    return "\n\n".join(blocks)


def run_gpu_check(out: str | None, quick: bool, device: str | None) -> int:
    """`logitgate bench --gpu`: the GPU check in a fresh process (its own output)."""
    cmd = [sys.executable, "-m", f"{BENCH_PACKAGE}.gpu_check"]
    if out:
        cmd += ["--out", str(make_output_folder(out))]  # the check writes its results there
    if quick:
        cmd.append("--quick")
    if device:
        cmd += ["--device", device]
    return subprocess.run(cmd, env=child_env(None)).returncode
