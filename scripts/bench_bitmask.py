"""Bitmask application on CPU: logitgate vs memcpy (the floor), xgrammar's CPU kernel, and a torch
unpack + masked_fill — one process, medians of many runs. Also the first call in a fresh process
(numba compile or cache load).

    python scripts/bench_bitmask.py [--quick] [--out FILE] [--plot FILE.png]
"""
from __future__ import annotations

import argparse

import torch

import logitgate
from logitgate.backends.reference import apply_token_bitmask_reference, pack_bitmask
from logitgate.benchmarking import emit, fresh_process_seconds, median_seconds, plot_bars

SHAPES = [(1, 32000), (8, 128256), (64, 128256), (256, 151936)]
DENSITIES = [0.5, 0.01]

FIRST_CALL = """
import time, torch
t0 = time.perf_counter()
import logitgate
t1 = time.perf_counter()
logits = torch.randn(64, 128256); bitmask = logitgate.allocate_token_bitmask(64, 128256); bitmask[:, ::2] = 0
logitgate.apply_token_bitmask_inplace(logits, bitmask)
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def bench_shape(rows: int, vocab: int, density: float, repeats: int) -> dict:
    import xgrammar

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g)
    source = logits.clone()
    bitmask = pack_bitmask(torch.rand(rows, vocab, generator=g) < density)
    cpu = logitgate.get_backend("cpu")
    times = {
        "memcpy": median_seconds(lambda: logits.copy_(source), repeats=repeats),
        "logitgate": median_seconds(lambda: logitgate.apply_token_bitmask_inplace(logits, bitmask, backend=cpu), repeats=repeats),
        "xgrammar_cpu": median_seconds(lambda: xgrammar.apply_token_bitmask_inplace(logits, bitmask), repeats=repeats),
        "torch_masked_fill": median_seconds(
            lambda: apply_token_bitmask_reference(logits, bitmask, None, vocab), repeats=max(3, repeats // 3)
        ),
    }
    row = {"shape": f"{rows}x{vocab}", "allowed": density, **{f"{k}_ms": v * 1e3 for k, v in times.items()}}
    row["vs_memcpy"] = times["logitgate"] / times["memcpy"]
    row["speedup_vs_xgrammar"] = times["xgrammar_cpu"] / times["logitgate"]
    row["speedup_vs_torch"] = times["torch_masked_fill"] / times["logitgate"]
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, skip the largest shape")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    repeats = 7 if args.quick else args.repeats
    shapes = SHAPES[:3] if args.quick else SHAPES
    result = {
        "benchmark": "bitmask_apply",
        "backend": "cpu",
        "torch_threads": torch.get_num_threads(),
        "fresh_process": fresh_process_seconds(FIRST_CALL),
        "goal": "(64,128256): <= 1.5x memcpy, >= 5x faster than xgrammar_cpu; first call < 2 s",
        "rows": [bench_shape(r, v, d, repeats) for r, v in shapes for d in DENSITIES],
    }
    emit(result, args.out)
    if args.plot:
        labels = [dict(row, label=f"{row['shape']} {row['allowed']:.0%}") for row in result["rows"]]
        plot_bars(labels, "label", ["memcpy_ms", "logitgate_ms", "xgrammar_cpu_ms"], "bitmask apply (CPU)", args.plot, "ms (median)")
    return result


if __name__ == "__main__":
    main()
