"""The check's JSON and markdown (rewritten after every step: a killed run leaves what it measured)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# logitgate GPU check: {env.get('device_name')}",
        "",
        f"{report['started']} UTC, host {env['host']}, Python {env['python']}, torch {env['torch']}, "
        f"triton {env.get('triton')}, xgrammar {env.get('xgrammar')}, {report['timing']}.",
        "",
    ]
    sync = report.get("sync_check")
    if sync:
        lines += ["## Host synchronisation in a decode step", ""]
        if not sync["checked"]:
            lines.append(f"Not checked: {sync['reason']} (every part ran).")
        lines += ["", "| part | result |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in sync["parts"].items()]
        overlap = report.get("overlap_check", {})
        if overlap.get("checked"):
            lines += ["", f"Side-stream noise {overlap['noise_shape']}: overlaps main-stream work: {overlap['overlaps']}, "
                      f"hidden behind it: {overlap['hidden']} (event times, us: {overlap['us']})."]
        lines.append("")
    bench = report.get("benchmarks", {})
    lines += variants_markdown(bench, report["environment"].get("device"))
    if bench.get("bitmask"):
        lines += ["## Bitmask apply", "",
                  "| shape | dtype | mask | implementation | us (median) | min-max | GB/s | of copy bandwidth | correct |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in bench["bitmask"]:
            for name, m in row["impl"].items():
                noisy = " (noisy)" if m["spread"] > 0.25 else ""
                lines.append(f"| {row['shape']} | {row['dtype']} | {row.get('mask', '50% allowed, random')} | {name} | "
                             f"{_fmt(m['us'])}{noisy} | {_fmt(m['us_min'])}-{_fmt(m['us_max'])} | {_fmt(m['gbps'])} | "
                             f"{m['fraction_of_copy']:.0%} | {row['correct'].get(name, '-')} |")
        lines.append("")
    for key, title in (("sampling", "Top-k / top-p + random sampling"), ("rejection", "Rejection sampling"), ("tree", "Tree")):
        for row in bench.get(key, []):
            lines += [f"## {title}: {row['case']}, {row['shape']}", "", "| implementation | us (median) | min-max |",
                      "| --- | --- | --- |"]
            lines += [f"| {name} | {_fmt(m['us'])}{' (noisy)' if m['spread'] > 0.25 else ''} | "
                      f"{_fmt(m['us_min'])}-{_fmt(m['us_max'])} |" for name, m in row["impl"].items()]
            if isinstance(row.get("correct"), dict):
                lines += ["", "equal to the torch reference: " + ", ".join(f"{k} {v}" for k, v in row["correct"].items())]
            ratios = {k: v for k, v in row.items() if k.startswith(("vs_", "speedup_"))}
            if ratios:
                lines += ["", ", ".join(f"{k} = {v:.2f}" for k, v in ratios.items())
                          + (f"; goal met: {row['goal_met']}" if "goal_met" in row else "")]
            lines.append("")
    if bench.get("errors"):
        lines += ["## Benchmark errors", ""] + [f"- {k}: {v}" for k, v in bench["errors"].items()] + [""]
    tests = report.get("tests")
    if tests:
        lines += ["## Tests", ""]
        if "skipped_reason" in tests:
            lines.append(f"Not run: {tests['skipped_reason']}.")
        else:
            lines.append(f"`{tests['command']}`: exit {tests['exit']} in {tests['seconds']} s; "
                         f"{tests.get('passed', '?')} passed, {tests.get('failures', '?')} failed, "
                         f"{tests.get('errors', '?')} errors, {tests.get('skipped', '?')} skipped.")
            lines += [f"- {f}" for f in tests.get("failed", [])[:50]]
        lines.append("")
    lines.append(f"Overall: {'PASS' if report.get('passed') else 'FAIL'} ({report.get('seconds', '?')} s).")
    return "\n".join(lines) + "\n"


def variants_json(bench: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """op -> [{case, current_us, v2_us, speedup_v2, faster, correct}] for the rows that timed both."""
    summary: dict[str, list[dict[str, Any]]] = {}
    for op in ("bitmask", "sampling", "rejection"):
        for row in bench.get(op, []):
            if "variants" in row:
                case = " ".join(str(row[key]) for key in ("shape", "dtype", "mask", "case") if key in row)
                summary.setdefault(op, []).append({"case": case, **row["variants"]})
    return summary


def variants_markdown(bench: dict[str, Any], device: str | None) -> list[str]:
    """The current-vs-v2 table of every benchmark row that timed both (LOGITGATE_CUDA_KERNELS)."""
    rows = [(op, row) for op in ("bitmask", "sampling", "rejection") for row in bench.get(op, []) if "variants" in row]
    if not rows:
        return []
    lines = ["## CUDA kernel variants: current vs v2 (LOGITGATE_CUDA_KERNELS)", ""]
    if device != "cuda":
        lines += ["CPU dry run: the variable selects CUDA kernels only, so both columns time the same CPU code.", ""]
    lines += ["| op | case | current us | v2 us | v2 speedup | faster | correct (current / v2) |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for op, row in rows:
        v = row["variants"]
        case = f"{row['shape']} {row['dtype']}, {row.get('mask', '')}" if op == "bitmask" else f"{row['shape']}, {row['case']}"
        correct = v.get("correct", {})
        lines.append(f"| {op} | {case} | {_fmt(v['current_us'])} | {_fmt(v['v2_us'])} | {v['speedup_v2']:.2f}x | "
                     f"{v['faster']} | {correct.get('current', '-')} / {correct.get('v2', '-')} |")
    return lines + [""]


def write_report(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))
