"""Helpers shared by the benchmark scripts, `logitgate bench` and the GPU check: timed runs with their
spread, interleaved (round-robin) timing, progress lines with an ETA, JSON output and PNG plots.
Benchmarks are scripts, never timed tests.

Row conventions (what `logitgate bench` reads back): `<impl>_ms` is the median time of an
implementation (lower is better), `<impl>_ms_min` / `<impl>_ms_max` its fastest and slowest run,
`<impl>_spread` the interquartile range over the median of its runs (noise), `speedup_vs_<x>` how many
times faster logitgate is than x (higher is better), `vs_<x>` / `*_ratio` logitgate's time over x's
(lower is better).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

# Runs whose interquartile range exceeds this fraction of their median are flagged as noisy.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder this logitgate is imported from


def package_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) with PACKAGE_ROOT first on PYTHONPATH: a child
    started as `python -m logitgate.bench.NAME`, in this interpreter or another, imports this same
    logitgate, not another installed copy."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
    return env


NOISY_SPREAD = 0.25


@dataclass(frozen=True)
class Timing:
    """The seconds of each timed run of one implementation."""

    runs: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def spread(self) -> float:
        """Interquartile range over the median (0 with fewer than 2 runs)."""
        if len(self.runs) < 2 or self.median == 0:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.runs, n=4, method="inclusive")
        return (q3 - q1) / self.median

    def fields(self, name: str) -> dict[str, float]:
        """The row fields of this timing under `name`, in milliseconds."""
        return {
            f"{name}_ms": self.median * 1e3,
            f"{name}_ms_min": min(self.runs) * 1e3,
            f"{name}_ms_max": max(self.runs) * 1e3,
            f"{name}_spread": self.spread,
        }


def time_runs(
    fn: Callable[[], Any], *, repeats: int = 15, warmup: int = 2, sync: Callable[[], None] | None = None
) -> Timing:
    """Wall time of `repeats` runs of `fn()` after `warmup` untimed runs (`sync` waits for queued
    device work before the clock is read)."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - start)
    return Timing(tuple(times))


def median_seconds(fn: Callable[[], Any], *, repeats: int = 15, warmup: int = 2, sync: Callable[[], None] | None = None) -> float:
    """Median wall time of `fn()` over `repeats` runs after `warmup` untimed runs."""
    return time_runs(fn, repeats=repeats, warmup=warmup, sync=sync).median


def round_robin(
    fns: dict[str, Callable[[], Any]], repeats: int | dict[str, int], *, timer: Callable[[Callable[[], Any]], float] | None = None
) -> dict[str, Timing]:
    """Time each fn `repeats` (or repeats[name]) times, one method after the other, so that load
    from other processes hits all of them alike. Every timed run follows an untimed run of the same
    fn (the other methods' runs in between would leave its data out of cache). `timer(fn)` returns
    the seconds of one run (default: wall time)."""
    counts = repeats if isinstance(repeats, dict) else {name: repeats for name in fns}
    timer = timer or (lambda fn: time_runs(fn, repeats=1, warmup=1).runs[0])
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(max(counts.values())):
        for name, fn in fns.items():
            if i < counts[name]:
                times[name].append(timer(fn))
    return {name: Timing(tuple(t)) for name, t in times.items()}


class Progress:
    """One line per benchmark step on stderr: the step, its number, elapsed time and an ETA from the
    mean time of the steps done so far. `logitgate bench` forwards these lines from its children."""

    def __init__(self, total: int, name: str, stream: TextIO | None = None) -> None:
        self.total, self.name, self.done = total, name, 0
        self.stream = stream or sys.stderr
        self.started = time.perf_counter()

    def step(self, label: str) -> None:
        elapsed = time.perf_counter() - self.started
        eta = f"ETA {elapsed / self.done * (self.total - self.done):.0f}s" if self.done else "ETA ?"
        self.done += 1
        self.stream.write(f"[{self.name}] step {self.done}/{self.total}: {label} ({elapsed:.0f}s elapsed, {eta})\n")
        self.stream.flush()


def fresh_process_seconds(code: str) -> dict[str, float]:
    """Run `code` in a new interpreter; it prints "<import seconds> <first call seconds>"."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import_s, call_s = map(float, out.stdout.split())
    return {"import_s": import_s, "first_call_s": call_s}


def emit(result: dict[str, Any], out: str | None) -> None:
    """Print the JSON result, or write it to `out` (a file path)."""
    text = json.dumps(result, indent=2)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    else:
        print(text)


# ---- plots ----------------------------------------------------------------------------------------

# One colour per implementation in every plot, no two implementations alike: logitgate's are blues,
# floors greys, each baseline its own colour.
IMPL_COLOURS = {
    "logitgate": "#1f5fbf", "logitgate_seeded": "#6fa0e6", "logitgate_dense_constrain": "#1f5fbf",
    "logitgate_dense_greedy": "#1f5fbf", "logitgate_sparse_greedy": "#00a0c8", "logitgate_advance": "#6fa0e6",
    "manager": "#1f5fbf",
    "memcpy": "#8c8c8c", "copy": "#8c8c8c", "clone": "#8c8c8c", "softmax_floor": "#5e5e5e", "one_read_floor": "#b0b0b0",
    "xgrammar": "#d62728", "xgrammar_cpu": "#d62728", "xgrammar_greedy": "#d62728", "xgrammar_constrain": "#d62728",
    "torch_masked_fill": "#ff7f0e", "multinomial": "#e6a000", "baseline": "#8c564b", "one_by_one": "#bcbd22",
    "exponential_trick": "#9467bd", "sort_reference": "#2ca02c", "vllm_torch": "#e377c2",
    "rtp_style_greedy": "#f0027f", "rtp_style_constrain": "#f0027f", "rtp_style_update": "#f0027f", "hf_greedy": "#a6761d",
    "one_thread": "#1f5fbf", "all_cores": "#d62728", "default": "#2ca02c",
}
_FALLBACK_COLOURS = ["#17becf", "#bcbd22", "#7f7f7f", "#8c564b", "#e377c2", "#9467bd"]

IMPL_LABELS = {
    "logitgate": "logitgate", "logitgate_seeded": "logitgate (seeded rows)",
    "logitgate_dense_constrain": "logitgate dense (fill + apply)", "logitgate_dense_greedy": "logitgate dense + argmax",
    "logitgate_sparse_greedy": "logitgate sparse (candidates)", "logitgate_advance": "logitgate advance",
    "manager": "logitgate StructuredOutputManager",
    "memcpy": "memcpy (floor)", "copy": "device copy (floor)", "clone": "clone (floor)",
    "softmax_floor": "one softmax (floor)", "one_read_floor": "one read of the logits (floor)",
    "xgrammar": "xgrammar kernel", "xgrammar_cpu": "xgrammar CPU kernel", "xgrammar_greedy": "xgrammar + argmax",
    "xgrammar_constrain": "xgrammar (fill + apply)",
    "torch_masked_fill": "torch unpack + masked_fill", "multinomial": "torch.multinomial",
    "baseline": "sort filters + multinomial", "one_by_one": "rows one by one (vLLM loop)",
    "exponential_trick": "plain exponential trick", "sort_reference": "sort-based reference",
    "vllm_torch": "vLLM's algorithm in torch",
    "rtp_style_greedy": "RTP-LLM style + argmax", "rtp_style_constrain": "RTP-LLM style (host mask)",
    "hf_greedy": "HF PrefixConstrained + argmax", "rtp_style_update": "RTP-LLM style key update",
    "one_thread": "1 thread", "all_cores": "all cores", "default": "logitgate's default (idle cores)",
}


def impl_colour(name: str) -> str:
    """The implementation's fixed colour (a stable pick for names not in IMPL_COLOURS)."""
    return IMPL_COLOURS.get(name) or _FALLBACK_COLOURS[zlib.crc32(name.encode()) % len(_FALLBACK_COLOURS)]


def impl_label(name: str) -> str:
    return IMPL_LABELS.get(name, name.replace("_", " "))


def machine_label() -> str:
    """The host in a few words: name, processor, cores."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{platform.node()}, {cpu}, {os.cpu_count()} cores"


def thread_label() -> str:
    import torch

    threads = f"torch threads: {torch.get_num_threads()}"
    if "numba" in sys.modules:
        from ..backends.cpu.threads import thread_cap

        threads += f", numba kernel threads: {min(sys.modules['numba'].get_num_threads(), thread_cap())}"
    return threads


def plot_bars(
    rows: list[dict[str, Any]],
    label_key: str,
    impls: list[str],
    title: str,
    path: str,
    *,
    ylabel: str = "ms per call (median; whiskers min-max)",
    subtitle: str | None = None,
) -> None:
    """Grouped bar chart on a log axis: one group per row (labelled by row[label_key]), one bar per
    implementation (row[f"{impl}_ms"], whiskers from `_ms_min`/`_ms_max` where recorded), one fixed
    colour per implementation, hatched bars where the run was noisy (spread > NOISY_SPREAD). The title
    names the machine and the thread counts (`subtitle` overrides the latter)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    impls = [name.removesuffix("_ms") for name in impls]
    impls = [name for name in impls if any(row.get(f"{name}_ms") for row in rows)]
    present = [[name for name in impls if row.get(f"{name}_ms")] for row in rows]
    width = 0.8 / max(1, max(map(len, present), default=1))
    fig, ax = plt.subplots(figsize=(min(16.0, max(7.0, 0.65 * sum(map(len, present)) + 3)), 5))
    any_noisy = False
    for j, (row, names) in enumerate(zip(rows, present)):
        for k, name in enumerate(names):  # the group's bars side by side, centred on its tick
            value = row[f"{name}_ms"]
            noisy = row.get(f"{name}_spread", 0.0) > NOISY_SPREAD
            any_noisy |= noisy
            err = [[value - row.get(f"{name}_ms_min", value)], [row.get(f"{name}_ms_max", value) - value]]
            ax.bar(j + (k - (len(names) - 1) / 2) * width, value, width, color=impl_colour(name), hatch="//" if noisy else "",
                   yerr=err, capsize=2, ecolor="#333333", error_kw={"linewidth": 0.8})
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([str(row[label_key]) for row in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", which="both", alpha=0.3)
    heading = [title, f"{machine_label()}; {subtitle or thread_label()}"]
    ax.set_title("\n".join(textwrap.fill(line, 90) for line in heading), fontsize=9)
    # Plain swatches: a legend entry must not inherit the hatch of whichever bar came first.
    handles = [Patch(facecolor=impl_colour(name)) for name in impls]
    labels = [impl_label(name) for name in impls]
    if any_noisy:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//"))
        labels.append(f"noisy (IQR > {NOISY_SPREAD:.0%} of median)")
    ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # nothing cut off: long titles, rotated labels
    plt.close(fig)
