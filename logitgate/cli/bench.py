"""`logitgate bench`: run the benchmark scripts of a source checkout, one table of ratios.

Each scripts/bench_*.py writes JSON (`--out`) and a PNG (`--plot`); this command runs them in
fresh processes (so a numba compile or a cache load is not charged to the next one), shows
progress, and prints every ratio the scripts report (keys named speedup_*, vs_*, *_ratio).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "scripts"
# Ratio keys: speedup_vs_x, dense_speedup_vs_x (faster is > 1), vs_x (time / baseline time), *_ratio.
RATIO_KEY = re.compile(r"(^|_)speedup(_|$)|^vs_|_ratio$")
CASE_KEYS = ("case", "op", "shape", "allowed", "mode", "batch", "vocab", "items", "k", "drafts")


def discover(only: list[str] | None = None) -> list[Path]:
    if not SCRIPTS_DIR.is_dir():
        raise ValueError(f"no scripts/ folder next to the package ({SCRIPTS_DIR}); run from a source checkout")
    scripts = sorted(SCRIPTS_DIR.glob("bench_*.py"))
    if only:
        names = {s.stem.removeprefix("bench_"): s for s in scripts}
        unknown = [o for o in only if o not in names]
        if unknown:
            raise ValueError(f"unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(sorted(names))}")
        scripts = [names[o] for o in only]
    return scripts


def ratios(result: dict) -> list[tuple[str, str, float]]:
    """(case, metric, value) for every ratio in a benchmark's JSON rows."""
    found = []
    for row in result.get("rows") or result.get("results") or []:
        labels = [f"{k}={row[k]}" for k in CASE_KEYS if k in row]
        case = " ".join(labels) or " ".join(str(v) for v in row.values() if isinstance(v, str))
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and RATIO_KEY.search(key):
                found.append((case, key, float(value)))
    return found


def _progress(i: int, n: int, name: str, width: int = 24) -> None:
    done = int(width * i / n)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {name:<24}")
    sys.stderr.flush()


def run(out: str, only: list[str] | None = None, quick: bool = False, device: str | None = None) -> dict:
    scripts = discover(only)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if device:
        env["LOGITGATE_DEVICE"] = device
    summary: dict[str, dict] = {}
    for i, script in enumerate(scripts):
        name = script.stem.removeprefix("bench_")
        _progress(i, len(scripts), name)
        json_path, png_path = out_dir / f"{name}.json", out_dir / f"{name}.png"
        cmd = [sys.executable, str(script), "--out", str(json_path), "--plot", str(png_path)]
        if quick:
            cmd.append("--quick")
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        entry: dict = {"seconds": round(time.perf_counter() - start, 1), "json": str(json_path), "png": str(png_path)}
        if proc.returncode != 0:
            entry["error"] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        else:
            entry["ratios"] = ratios(json.loads(json_path.read_text()))
        summary[name] = entry
    _progress(len(scripts), len(scripts), "done")
    sys.stderr.write("\n")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def format_table(summary: dict) -> str:
    lines = [f"{'benchmark':<12} {'case':<44} {'metric':<28} {'value':>8}", "-" * 95]
    for name, entry in summary.items():
        if "error" in entry:
            lines.append(f"{name:<12} FAILED: {entry['error']}")
            continue
        for case, metric, value in entry["ratios"]:
            lines.append(f"{name:<12} {case[:44]:<44} {metric[:28]:<28} {value:>8.2f}")
    lines.append("ratios: *speedup* > 1 means logitgate is faster than that baseline; vs_* is logitgate time / baseline time")
    return "\n".join(lines)
