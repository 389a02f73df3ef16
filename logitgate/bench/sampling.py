"""Sampling on CPU, one process, medians of many runs:

- random_sample (inverse CDF, one uniform per row) vs torch.multinomial and the plain exponential
  trick argmax(p / q) with q drawn over the whole vocabulary;
- top-k / top-p (numba: heap / histogram, no sort) vs the sort-based reference;
- a whole Sampler step (temperature, top-k, top-p, draw) with logitgate's kernels vs the same step
  built from the baselines (sort-based filters, torch.multinomial);
- the first call in a fresh process (numba compile or cache load).

    python -m logitgate.bench.sampling [--quick] [--threads N] [--out FILE] [--plot FILE.png]
"""
from __future__ import annotations

import argparse

import numba
import torch

from logitgate.backends.cpu.threads import set_thread_cap, thread_cap
from logitgate.backends.reference import apply_top_k_top_p_reference
from logitgate.bench.harness import Progress, emit, fresh_process_seconds, plot_bars, round_robin
from logitgate.sampling import Sampler, SamplingMetadata, SamplingParams, ops

SHAPES = [(1, 128256), (8, 128256), (64, 128256), (256, 151936)]
GOAL = "(64,128256): random_sample >= 3x faster than torch.multinomial and than the plain exponential trick"

FIRST_CALL = """
import time, torch
t0 = time.perf_counter()
from logitgate.sampling import ops
t1 = time.perf_counter()
probs = torch.rand(64, 128256)
ops.random_sample(probs)
ops.apply_top_k_top_p(torch.randn(64, 128256), torch.full((64,), 50), torch.full((64,), 0.9))
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def make_logits(rows: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows)
    return torch.randn(rows, vocab, generator=g) * 3  # a peaked, LLM-like spread


def _fields(runs: dict) -> dict:
    return {key: value for name, timing in runs.items() for key, value in timing.fields(name).items()}


def exponential_trick(probs: torch.Tensor) -> torch.Tensor:
    return probs.div(torch.empty_like(probs).exponential_()).argmax(dim=-1)


def bench_random_sample(rows: int, vocab: int, repeats: int) -> dict:
    probs = make_logits(rows, vocab).softmax(dim=-1)
    generators = {r: torch.Generator().manual_seed(r) for r in range(rows)}
    runs = round_robin({
        "logitgate": lambda: ops.random_sample(probs, backend="cpu"),
        "logitgate_seeded": lambda: ops.random_sample(probs, generators, backend="cpu"),
        "multinomial": lambda: torch.multinomial(probs, 1),
        "exponential_trick": lambda: exponential_trick(probs),
    }, repeats)
    times = {name: t.median for name, t in runs.items()}
    row = {"op": "random_sample", "shape": f"{rows}x{vocab}", **_fields(runs)}
    row["speedup_vs_multinomial"] = times["multinomial"] / times["logitgate"]
    row["speedup_vs_exponential_trick"] = times["exponential_trick"] / times["logitgate"]
    return row


def vllm_top_k_top_p_sample(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's sampling algorithm, written here in torch (the baseline of the GPU check): sort each row
    ascending; top-k masks what is below the k-th largest value; top-p masks the sorted tokens whose
    cumulative probability stays within 1 - p (never the largest); scatter back in place; softmax;
    then the exponential trick argmax(p / q), q ~ Exp(1) over the whole vocabulary."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if k is not None:
        kth = sorted_logits.gather(1, (logits.shape[1] - k.long()).clamp(min=0).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - p.unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    probs = logits.scatter_(1, order, sorted_logits).softmax(dim=-1, dtype=torch.float32)
    return probs.div_(torch.empty_like(probs).exponential_()).argmax(dim=-1)


FILTERS = {"top_k=50": (50, None), "top_p=0.9": (None, 0.9), "top_k=50,top_p=0.9": (50, 0.9), "top_k=1000,top_p=0.95": (1000, 0.95)}


def bench_filters(rows: int, vocab: int, name: str, repeats: int) -> dict:
    logits = make_logits(rows, vocab)
    k_value, p_value = FILTERS[name]
    k = None if k_value is None else torch.full((rows,), k_value)
    p = None if p_value is None else torch.full((rows,), p_value)
    runs = round_robin({
        "clone": lambda: logits.clone(),
        "logitgate": lambda: ops.apply_top_k_top_p(logits.clone(), k, p, backend="cpu"),
        "sort_reference": lambda: apply_top_k_top_p_reference(logits.clone(), k, p),
    }, {"clone": repeats, "logitgate": repeats, "sort_reference": max(3, repeats // 3)})
    times = {name: t.median for name, t in runs.items()}
    row = {"op": f"top_k_top_p {name}", "shape": f"{rows}x{vocab}", **_fields(runs)}
    row["speedup_vs_sort_reference"] = times["sort_reference"] / times["logitgate"]
    return row


def baseline_step(logits: torch.Tensor, temperature: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    scaled = logits / temperature.unsqueeze(1)
    return torch.multinomial(apply_top_k_top_p_reference(scaled, k, p).softmax(dim=-1), 1)


def bench_sampler(rows: int, vocab: int, repeats: int) -> dict:
    logits = make_logits(rows, vocab)
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9)] * rows
    meta = SamplingMetadata.from_params(params)
    sampler = Sampler(backend="cpu")
    runs = round_robin({
        "logitgate": lambda: sampler(logits.clone(), meta),
        "baseline": lambda: baseline_step(logits.clone(), meta.temperature, meta.top_k, meta.top_p),
    }, {"logitgate": repeats, "baseline": max(3, repeats // 3)})
    times = {name: t.median for name, t in runs.items()}
    row = {"op": "sampler step t=0.8,top_k=50,top_p=0.9", "shape": f"{rows}x{vocab}", **_fields(runs)}
    row["speedup_vs_baseline"] = times["baseline"] / times["logitgate"]
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, the (64,128256) shape only")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, help="torch and numba threads (default: torch's own; the numba kernels "
                        "use the idle cores, docs/devices.md 'Threads')")
    parser.add_argument("--out")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        numba.set_num_threads(args.threads)
        set_thread_cap(args.threads)  # an explicit choice is not capped
    repeats = 7 if args.quick else args.repeats
    shapes = [(64, 128256)] if args.quick else SHAPES
    progress = Progress(len(shapes) + len(FILTERS) + 2, "sampling")
    rows = []
    for r, v in shapes:
        progress.step(f"random_sample {r}x{v}")
        rows.append(bench_random_sample(r, v, repeats))
    for name in FILTERS:
        progress.step(f"top-k/top-p {name} 64x128256")
        rows.append(bench_filters(64, 128256, name, repeats))
    progress.step("Sampler step 64x128256")
    rows.append(bench_sampler(64, 128256, repeats))
    progress.step("first call in a fresh process")
    main_row = next(row for row in rows if row["op"] == "random_sample" and row["shape"] == "64x128256")
    result = {
        "benchmark": "sampling",
        "backend": "cpu",
        "torch_threads": torch.get_num_threads(),
        "numba_threads": min(numba.get_num_threads(), thread_cap()),
        "fresh_process": fresh_process_seconds(FIRST_CALL),
        "goal": GOAL,
        "goal_met": main_row["speedup_vs_multinomial"] >= 3 and main_row["speedup_vs_exponential_trick"] >= 3,
        "rows": rows,
    }
    emit(result, args.out)
    if args.plot:
        labels = [dict(row, label=f"{row['op']} {row['shape']}") for row in rows]
        keys = ["clone", "logitgate", "logitgate_seeded", "multinomial", "exponential_trick", "sort_reference", "baseline"]
        plot_bars(labels, "label", keys, "sampling (CPU)", args.plot)
    return result


if __name__ == "__main__":
    main()
