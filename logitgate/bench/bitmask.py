"""Bitmask application on CPU: logitgate vs memcpy (the floor), xgrammar's CPU kernel, and a torch
unpack + masked_fill — one process, medians of many runs. Also the first call in a fresh process,
once with an empty numba cache (compile) and once with the cache it filled (cache load).

The methods are timed in round robin (one run of each, repeated), so load from other processes on
a shared machine hits all of them alike; each timed run follows an untimed run of the same method,
so caches are as warm as in back-to-back runs. `<impl>_spread` is the interquartile range over the
median of that implementation's runs, a measure of that noise.

    python -m logitgate.bench.bitmask [--quick] [--dtypes float32,bfloat16] [--out FILE] [--plot FILE.png]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

import logitgate
from logitgate.backends.cpu.threads import set_thread_cap
from logitgate.backends.formats import pack_bitmask
from logitgate.backends.reference import apply_token_bitmask_reference
from logitgate.bench.harness import Progress, emit, plot_bars, round_robin

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


def first_call_seconds() -> dict[str, float]:
    """Import and first-call times of a fresh process: with an empty numba cache, then with the
    cache that run filled."""
    result = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
        for kind in ("compile", "cached"):
            out = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True, check=True, env=env)
            import_s, call_s = map(float, out.stdout.split())
            result[f"{kind}_import_s"] = import_s
            result[f"{kind}_first_call_s"] = call_s
    return result


def numba_threads() -> int:
    import numba

    from logitgate.backends.cpu.threads import thread_cap

    return min(numba.get_num_threads(), thread_cap())  # what the kernels use


def bench_shape(rows: int, vocab: int, density: float, dtype: torch.dtype, repeats: int) -> dict:
    import xgrammar

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    source = logits.clone()
    bitmask = pack_bitmask(torch.rand(rows, vocab, generator=g) < density)
    cpu = logitgate.get_backend("cpu")
    fns = {
        "memcpy": lambda: logits.copy_(source),
        "logitgate": lambda: logitgate.apply_token_bitmask_inplace(logits, bitmask, backend=cpu),
        "xgrammar_cpu": lambda: xgrammar.apply_token_bitmask_inplace(logits, bitmask),
        "torch_masked_fill": lambda: apply_token_bitmask_reference(logits, bitmask, None, vocab),
    }
    runs = round_robin(fns, {name: repeats if name != "torch_masked_fill" else max(3, repeats // 3) for name in fns})
    times = {name: t.median for name, t in runs.items()}
    row = {"shape": f"{rows}x{vocab}", "dtype": str(dtype).removeprefix("torch."), "allowed": density}
    for name, timing in runs.items():
        row.update(timing.fields(name))
    row["vs_memcpy"] = times["logitgate"] / times["memcpy"]
    row["speedup_vs_xgrammar"] = times["xgrammar_cpu"] / times["logitgate"]
    row["speedup_vs_torch"] = times["torch_masked_fill"] / times["logitgate"]
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, skip the largest shape")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--dtypes", default="float32", help="comma-separated logits dtypes (float32, float16, bfloat16)")
    parser.add_argument(
        "--threads", type=int, help="torch and numba threads (default: torch's own; the numba kernels use the idle cores, "
        "docs/devices.md 'Threads'); 1 gives steadier numbers on a loaded machine"
    )
    parser.add_argument("--out")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    repeats = 7 if args.quick else args.repeats
    shapes = SHAPES[:3] if args.quick else SHAPES
    dtypes = [getattr(torch, name.strip()) for name in args.dtypes.split(",")]
    if args.threads:
        import numba

        torch.set_num_threads(args.threads)
        numba.set_num_threads(args.threads)
        set_thread_cap(args.threads)  # an explicit choice is not capped
    cases = [(r, v, d, dt) for dt in dtypes for r, v in shapes for d in DENSITIES]
    progress = Progress(len(cases) + 1, "bitmask")
    progress.step("first call in a fresh process (numba compile, then cache load)")
    result = {
        "benchmark": "bitmask_apply",
        "backend": "cpu",
        "torch_threads": torch.get_num_threads(),
        "numba_threads": numba_threads(),
        "fresh_process": first_call_seconds(),
        "goal": "(64,128256): <= 1.5x memcpy, >= 5x faster than xgrammar_cpu; first call < 2 s",
        "rows": [],
    }
    for r, v, d, dt in cases:
        progress.step(f"{r}x{v} {str(dt).removeprefix('torch.')} {d:.0%} allowed")
        result["rows"].append(bench_shape(r, v, d, dt, repeats))
    emit(result, args.out)
    if args.plot:
        labels = [dict(row, label=f"{row['shape']} {row['dtype']} {row['allowed']:.0%}") for row in result["rows"]]
        plot_bars(labels, "label", ["memcpy", "logitgate", "xgrammar_cpu", "torch_masked_fill"], "bitmask apply (CPU)", args.plot)
    return result


if __name__ == "__main__":
    main()
