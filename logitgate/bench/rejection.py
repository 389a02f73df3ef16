"""Rejection sampling (random mode, with draft probs) on CPU: logitgate vs a vectorised torch
version of vLLM's algorithm (written here, the baseline) vs one softmax over the target logits (the
floor) — one process, medians of many runs. Also the first call in a fresh process (numba compile
or cache load).

    python -m logitgate.bench.rejection [--quick] [--repeats N] [--out FILE] [--plot FILE.png]

Scenarios: "drafter" = draft probs from a perturbed copy of the target (a realistic acceptance
rate); "exact" = draft probs equal to the target (every draft accepted: every row is read, the
worst case for logitgate's lazy kernels).
"""
from __future__ import annotations

import argparse
import subprocess
import sys

import torch

from logitgate.backends import get_backend
from logitgate.bench.harness import Progress, emit, plot_bars, round_robin
from logitgate.sampling.rejection import rejection_sample

BATCH, SPEC, VOCAB = 64, 4, 128256

FIRST_CALL = f"""
import time, torch
t0 = time.perf_counter()
from logitgate.sampling.rejection import rejection_sample
t1 = time.perf_counter()
n = {BATCH} * {SPEC}
logits = torch.randn(n, {VOCAB}); probs = torch.softmax(torch.randn(n, {VOCAB}), -1)
drafts = torch.randint(0, {VOCAB}, (n,))
rejection_sample(drafts, [{SPEC}] * {BATCH}, logits, torch.zeros({BATCH}, dtype=torch.int64), draft_probs=probs,
                 temperature=torch.ones({BATCH}), backend="cpu")
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def vllm_torch(draft_token_ids, target_logits, bonus_token_ids, draft_probs, temperature):
    """vLLM's random-mode rejection sampler, vectorised in torch (equal draft counts per request):
    full softmax, float64 uniforms per draft, one Exp(1) row per request, the recovered token
    argmax(max(p - q, 0) / E) at EVERY position, then the sequential accept as a cumprod. Runs on the
    inputs' device (the GPU check uses it on CUDA)."""
    batch = bonus_token_ids.numel()
    spec = draft_token_ids.numel() // batch
    logits = target_logits.float() / temperature.repeat_interleave(spec).unsqueeze(-1)
    target_probs = logits.softmax(-1, dtype=torch.float32)
    device = target_logits.device
    uniform = torch.rand(draft_token_ids.numel(), dtype=torch.float64, device=device)
    q = torch.empty(batch, target_logits.shape[-1], device=device).exponential_()
    residual = (target_probs - draft_probs).clamp_min_(0).view(batch, spec, -1)
    recovered = residual.div_(q.unsqueeze(1)).argmax(-1)  # (B, K)
    ids = draft_token_ids.unsqueeze(-1)
    draft_p = draft_probs.gather(-1, ids).squeeze(-1)
    target_p = target_probs.gather(-1, ids).squeeze(-1)
    accept = ((draft_p > 0) & (target_p / draft_p >= uniform)).view(batch, spec)
    accepted = accept.int().cumprod(1).sum(1)
    out = torch.full((batch, spec + 1), -1, dtype=torch.int32, device=device)
    positions = torch.arange(spec + 1, device=device)
    drafts = draft_token_ids.view(batch, spec)
    out[:, :spec] = torch.where(positions[:spec] < accepted.unsqueeze(-1), drafts, -1).int()
    final = torch.where(accepted < spec, recovered.gather(1, accepted.clamp(max=spec - 1).unsqueeze(-1)).squeeze(-1), bonus_token_ids)
    out.scatter_(1, accepted.long().unsqueeze(-1), final.int().unsqueeze(-1))
    return out


def make_inputs(scenario: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = BATCH * SPEC
    logits = torch.randn(n, VOCAB, generator=g) * 2.0
    if scenario == "exact":
        probs = logits.softmax(-1)
    else:
        probs = (logits + torch.randn(n, VOCAB, generator=g) * 0.5).softmax(-1)
    drafts = torch.multinomial(probs, 1, generator=g).squeeze(-1)
    bonus = torch.randint(0, VOCAB, (BATCH,), generator=g)
    return drafts, logits, bonus, probs, torch.ones(BATCH)


def bench(scenario: str, repeats: int) -> dict:
    drafts, logits, bonus, probs, temperature = make_inputs(scenario)
    cpu = get_backend("cpu")
    counts = [SPEC] * BATCH

    def ours():
        return rejection_sample(drafts, counts, logits, bonus, draft_probs=probs, temperature=temperature, backend=cpu)

    out = ours()
    emitted = int((out >= 0).sum()) / BATCH  # accepted drafts + 1 per request
    fns = {
        "softmax_floor": lambda: logits.softmax(-1),
        "logitgate": ours,
        "vllm_torch": lambda: vllm_torch(drafts, logits, bonus, probs, temperature),
    }
    runs = round_robin(fns, {"softmax_floor": repeats, "logitgate": repeats, "vllm_torch": max(5, repeats // 2)})
    times = {name: t.median for name, t in runs.items()}
    row = {"scenario": scenario, "mean_emitted_tokens": emitted}
    for name, timing in runs.items():
        row.update(timing.fields(name))
    row["vs_floor"] = times["logitgate"] / times["softmax_floor"]
    row["speedup_vs_vllm_torch"] = times["vllm_torch"] / times["logitgate"]
    return row


def first_call_seconds() -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True, check=True)
    import_s, call_s = map(float, out.stdout.split())
    return {"import_s": import_s, "first_call_s": call_s}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    repeats = 5 if args.quick else args.repeats
    result = {
        "benchmark": "rejection_sample",
        "backend": "cpu",
        "shape": {"batch": BATCH, "spec_tokens": SPEC, "vocab": VOCAB, "mode": "random, draft probs"},
        "torch_threads": torch.get_num_threads(),
        "goal": "drafter scenario: <= 2.5x softmax_floor and >= 1.5x faster than vllm_torch",
        "rows": [],
    }
    progress = Progress(3, "rejection")
    progress.step("first call in a fresh process")
    result["fresh_process"] = first_call_seconds()
    for scenario in ("drafter", "exact"):
        progress.step(f"B={BATCH} k={SPEC} V={VOCAB}, {scenario} draft probs")
        result["rows"].append(bench(scenario, repeats))
    emit(result, args.out)
    if args.plot:
        plot_bars(result["rows"], "scenario", ["softmax_floor", "logitgate", "vllm_torch"],
                  f"rejection sampling (random, draft probs), CPU, B={BATCH} k={SPEC} V={VOCAB}", args.plot)
    return result


if __name__ == "__main__":
    main()
