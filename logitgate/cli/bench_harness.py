"""Helpers shared by the benchmark scripts and `logitgate bench`: medians of many timed runs, JSON
output, optional PNG plots. Benchmarks are scripts, never timed tests."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def median_seconds(fn: Callable[[], Any], *, repeats: int = 15, warmup: int = 2, sync: Callable[[], None] | None = None) -> float:
    """Median wall time of `fn()` over `repeats` runs after `warmup` untimed runs."""
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
    return statistics.median(times)


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


def plot_bars(rows: list[dict[str, Any]], label_key: str, value_keys: list[str], title: str, path: str, ylabel: str) -> None:
    """Grouped bar chart: one group per row (labelled by row[label_key]), one bar per value key."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    width = 0.8 / len(value_keys)
    for i, key in enumerate(value_keys):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [row.get(key) or 0 for row in rows], width, label=key)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([str(row[label_key]) for row in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
