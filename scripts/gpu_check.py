"""The GPU check: one command for a lent GPU machine (`make gpu-check`, `logitgate bench --gpu`).

Made for the machines as they are: Python 3.12 with CUDA torch and Triton preinstalled, numba and
pytest present, no network. Packages they lack (xgrammar, hypothesis and what those import) come as
wheels from a folder next to the checkout (`make gpu-wheels` fills .gpu-wheels/) and are installed
with `pip --no-index` when missing. One run, at most --budget-s seconds (default 600):

1. environment: device, versions, the packages installed from the wheel folder;
2. sync check: one decode step (tree advance + fill + bitmask apply, the Sampler with its noise
   prefetched, rejection sampling) under torch.cuda.set_sync_debug_mode("error"), part by part, and
   whether the exponential-trick noise drawn on the side stream really overlaps main-stream work
   (CUDA events, no synchronize() inside the step);
3. benchmarks with CUDA events, medians of interleaved runs (L2 flushed between runs), in this
   process: bitmask apply vs xgrammar's kernel and torch masked_fill, as us, GB/s and the fraction of
   the device-to-device copy bandwidth measured in the same run; top-k/top-p + random sampling vs
   vLLM's algorithm in torch and the sort-based reference; rejection sampling (B=64, k=4) vs vLLM's
   algorithm in torch and one read of the logits (the floor); tree fill, candidates, and the sparse
   path's kernels (gather candidates, keep only allowed, fill) vs their torch reference;
4. the test suite with LOGITGATE_DEVICE=cuda and native Triton (no interpreter), in what is left of
   the budget.

Results: one JSON (gpu_check.json, rewritten after every step, so a killed run still leaves what it
measured) and one markdown table (gpu_check.md) in the folder it prints. `--device cpu` is the dry
run: the same code on CPU tensors with small shapes, timed with perf_counter, no sync check (the
CPU has none to detect) and no tests unless --pytest-args names some.

    python scripts/gpu_check.py [--device cuda|cpu] [--out DIR] [--quick] [--budget-s 600]
                                [--wheels DIR] [--skip-tests] [--skip-bench] [--pytest-args "..."]
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent
for path in (str(REPO), str(SCRIPTS)):  # this checkout's logitgate; the other benchmark scripts' baselines
    if path not in sys.path:
        sys.path.insert(0, path)

# Modules the check needs that the GPU machines may lack -> the pip names to install from the wheels.
NEEDED = {"xgrammar": "xgrammar", "hypothesis": "hypothesis"}
DEFAULT_WHEELS = REPO / ".gpu-wheels"

# Goals (issue 14), evaluated on CUDA only.
GOAL_COPY_FRACTION = 0.80
GOAL_FLOOR_RATIO = 1.5

SHAPES = {
    "cuda": {
        "bitmask": [(64, 128256), (256, 151936)],
        "bitmask_grammar": (64, 128256),
        "sampling": (64, 128256),
        "rejection": (64, 4, 128256),
        "tree": (64, 128256, 20000),
        "noise": (256, 151936),
    },
    "cpu": {  # the dry run: small enough for a CI test
        "bitmask": [(4, 4096), (8, 8192)],
        "bitmask_grammar": (4, 8192),
        "sampling": (8, 8192),
        "rejection": (4, 4, 4096),
        "tree": (8, 8192, 500),
        "noise": (8, 8192),
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


# ---- 0. environment and packages ------------------------------------------------------------------


def ensure_packages(wheels: str | Path, needed: dict[str, str] = NEEDED, site: Path | None = None) -> dict[str, str]:
    """module -> "present" | "installed from <wheels>..." | "missing: <why>". Installs the missing ones
    from `wheels` only (no network on the GPU machines): into the interpreter's environment with
    pip --no-index; where that is refused (a read-only or externally managed Python), every wheel
    with --no-deps --target `site` (.gpu-site/ next to the checkout), appended to sys.path and to the
    tests' PYTHONPATH, so the machine's own packages (torch, triton) still come first."""
    site = site or REPO / ".gpu-site"
    status = {m: "present" for m in needed if importlib.util.find_spec(m) is not None}
    missing = [m for m in needed if m not in status]
    if not missing:
        return status
    wheels = Path(wheels)
    wheel_files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not wheel_files:
        for m in missing:
            status[m] = f"missing: no wheels in {wheels} (run `make gpu-wheels` on a machine with network)"
        return status
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index"]
    proc = subprocess.run([*pip, "--find-links", str(wheels), *(needed[m] for m in missing)], capture_output=True, text=True)
    how = f"installed from {wheels}"
    if proc.returncode != 0:
        proc = subprocess.run([*pip, "--no-deps", "--target", str(site), *map(str, wheel_files)], capture_output=True, text=True)
        how = f"installed from {wheels} into {site}"
        if proc.returncode == 0:
            add_site(site)
    importlib.invalidate_caches()
    for m in missing:
        if proc.returncode == 0 and importlib.util.find_spec(m) is not None:
            status[m] = how
        else:
            tail = (proc.stderr.strip().splitlines() or [f"pip exit {proc.returncode}"])[-1]
            status[m] = f"missing: pip install failed: {tail}"
    return status


def add_site(site: Path) -> None:
    """Make packages installed into `site` importable here and in the test run, after the machine's own."""
    if str(site) not in sys.path:
        sys.path.append(str(site))
    os.environ["LOGITGATE_GPU_SITE"] = str(site)


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_cores": os.cpu_count(),
        "device": device,
    }
    for module in ("triton", "numba", "xgrammar", "hypothesis", "logitgate"):
        try:
            importlib.import_module(module)
            env[module] = importlib.metadata.version(module)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            env[module] = f"unavailable: {type(exc).__name__}: {exc}"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            device_name=torch.cuda.get_device_name(0),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
    else:
        env["device_name"] = f"CPU ({platform.processor() or platform.machine()}), dry run"
    env["triton_interpret"] = os.environ.get("TRITON_INTERPRET") == "1"
    return env


# ---- timing ---------------------------------------------------------------------------------------


class Timer:
    """Seconds of one run of fn: CUDA events around it (L2 flushed first, so a 30 MB operand is not
    served from a 50 MB cache), or perf_counter on the CPU. `fn` may be (setup, fn): setup runs
    untimed before each run (restoring inputs that fn modifies)."""

    def __init__(self, device: str) -> None:
        import torch

        self.device = device
        self.cuda = device == "cuda"
        if self.cuda:
            self._flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn: Callable[[], Any] | tuple[Callable[[], Any], Callable[[], Any]]) -> float:
        import torch

        setup, run = fn if isinstance(fn, tuple) else (None, fn)
        if setup:
            setup()
        if not self.cuda:
            start = time.perf_counter()
            run()
            return time.perf_counter() - start
        self._flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def warm(self, fn) -> None:
        setup, run = fn if isinstance(fn, tuple) else (None, fn)
        if setup:
            setup()
        run()


def timed(fns: dict[str, Any], timer: Timer, repeats: int) -> dict[str, Any]:
    """Interleaved runs of every implementation (round robin), after one warm-up run each."""
    from logitgate.bench.harness import round_robin

    for fn in fns.values():
        timer.warm(fn)
    return round_robin(fns, repeats, timer=timer)


def in_variant(op: str, variant: str, fn):
    """fn (or (setup, fn)) run with LOGITGATE_CUDA_KERNELS selecting `variant` for `op` (the
    variable is read at every call, so variants interleave in one process under the same timer)."""
    from logitgate.backends.variants import selected

    setup, run = fn if isinstance(fn, tuple) else (None, fn)

    def selected_run():
        with selected(op, variant):
            return run()

    return (setup, selected_run) if setup else selected_run


def variant_summary(runs: dict, correct: dict | None = None) -> dict[str, Any]:
    """current vs v2 from interleaved runs named "logitgate" (current) and "logitgate_v2"."""
    current, v2 = runs["logitgate"].median, runs["logitgate_v2"].median
    summary = {"current_us": current * 1e6, "v2_us": v2 * 1e6, "speedup_v2": current / v2,
               "faster": "v2" if v2 < current else "current"}
    if correct is not None:
        summary["correct"] = {"current": correct.get("logitgate"), "v2": correct.get("logitgate_v2")}
    return summary


def _us(timing) -> dict[str, float]:
    return {"us": timing.median * 1e6, "us_min": min(timing.runs) * 1e6, "us_max": max(timing.runs) * 1e6,
            "spread": timing.spread}


# ---- 2. the sync check ----------------------------------------------------------------------------


def decode_step_parts(backend, shapes: dict) -> dict[str, Callable[[], Any]]:
    """The parts of one decode step, inputs prepared (and uploaded) beforehand as an engine would."""
    import torch

    import logitgate
    from bench_tree import batch_prefixes, make_catalog, prefix_dict_config
    from logitgate import TreeDFA
    from logitgate.backends.base import CandidateRows
    from logitgate.sampling import Sampler, SamplingMetadata, SamplingParams
    from logitgate.sampling.rejection import rejection_sample

    dev = backend.device
    batch, vocab, items = shapes["tree"]
    catalog = make_catalog(items)
    tree = TreeDFA.from_prefix_dict(prefix_dict_config(catalog), vocab_size=vocab, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    prefixes = (batch_prefixes(catalog) * (batch // 64 + 1))[:batch]  # rows two tokens into their items
    states = torch.tensor([tree.walk(p[:1]) for p in prefixes], device=dev)
    tokens = torch.tensor([p[1] for p in prefixes], device=dev)
    bitmask = logitgate.allocate_token_bitmask(batch, vocab, device=dev)
    logits = torch.randn(batch, vocab, device=dev, generator=g)
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9)] * batch
    metadata = SamplingMetadata.from_params(params, device=dev)
    sampler = Sampler(backend=backend)
    rb, k, rv = shapes["rejection"]
    target = torch.randn(rb * k, rv, device=dev, generator=g)
    draft_probs = torch.softmax(target + torch.randn(rb * k, rv, device=dev, generator=g) * 0.5, dim=-1)
    drafts = torch.randint(0, rv, (rb * k,), device=dev, generator=g)
    bonus = torch.randint(0, rv, (rb,), device=dev, generator=g)
    temperature = torch.ones(rb, device=dev)
    counts = [k] * rb
    state = {"states": states}
    tree_args, width = tree_kernel_args(tree, states)  # the layout's width is known before the step
    kept = logits.clone()

    def advance():
        state["states"] = tree.advance(states, tokens)

    def sample():
        metadata.prefetch_noise(batch, vocab, backend=backend)
        return sampler(logits, metadata).sampled_token_ids

    def apply():
        logitgate.apply_token_bitmask_inplace(logits, bitmask, backend=backend)

    def reject():
        return rejection_sample(drafts, counts, target, bonus, draft_probs=draft_probs, temperature=temperature, backend=backend)

    return {
        "tree advance": advance,
        "tree fill_bitmask": lambda: tree.fill_bitmask(state["states"], bitmask),
        "apply_token_bitmask": apply,
        "tree candidates": lambda: tree.candidates(state["states"]),
        "tree gather candidates (sparse layout)": lambda: backend.gather_candidate_logits(logits, CandidateRows(*tree_args, width)),
        "tree keep only allowed": lambda: backend.keep_candidate_logits(kept, CandidateRows(*tree_args, width)),
        "Sampler (noise prefetched on the side stream, top-k/top-p, draw)": sample,
        "rejection_sample (B=%d, k=%d, draft probs)" % (rb, k): reject,
        # The v2 CUDA kernels (LOGITGATE_CUDA_KERNELS) must not synchronise either.
        "apply_token_bitmask, v2": in_variant("bitmask", "v2", apply),
        "Sampler, v2 (Philox seeds prefetched, one-go top-k/top-p/draw)": in_variant("sampling", "v2", sample),
        "rejection_sample, v2": in_variant("rejection", "v2", reject),
    }


def sync_check(backend, shapes: dict) -> dict[str, Any]:
    """Each part of a decode step under set_sync_debug_mode("error") (CUDA): "ok" or the error."""
    import torch

    parts = decode_step_parts(backend, shapes)
    for fn in parts.values():  # compile and warm up outside the check (first launches may sync)
        fn()
    cuda = backend.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    results: dict[str, str] = {}
    for name, fn in parts.items():
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
            results[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - every part is reported
            results[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    if cuda:
        torch.cuda.synchronize()
        syncs = [name for name, r in results.items() if r != "ok"]
        return {"checked": True, "parts": results, "host_syncs": len(syncs), "passed": not syncs}
    return {"checked": False, "reason": "CPU dry run: there is no host/device boundary to detect",
            "parts": results, "passed": all(r == "ok" for r in results.values())}


def overlap_check(backend, shapes: dict) -> dict[str, Any]:
    """Does the noise drawn on the side stream run while the main stream works? The draw is queued
    first (as Sampler.prefetch_noise before a forward pass), then ~1 ms of main-stream work; CUDA
    events on both streams are read after one synchronize at the end."""
    import torch

    if backend.device.type != "cuda":
        return {"checked": False, "reason": "CPU dry run: no side stream", "passed": True}
    batch, vocab = shapes["noise"]
    backend.draw_sampling_noise(batch, vocab, None)  # warm-up
    torch.cuda.synchronize()
    ev = {name: torch.cuda.Event(enable_timing=True) for name in ("ref", "side_start", "side_end", "main_start", "main_end")}
    ev["ref"].record()
    with backend.side_stream():
        ev["side_start"].record()
    noise = backend.draw_sampling_noise(batch, vocab, None)
    with backend.side_stream():
        ev["side_end"].record()
    ev["main_start"].record()
    torch.cuda._sleep(2_000_000)  # stands in for the forward pass
    ev["main_end"].record()
    backend.wait_event(noise.event)  # what random_sample does: a device-side wait
    torch.cuda.synchronize()
    t = {name: ev["ref"].elapsed_time(e) * 1e3 for name, e in ev.items() if name != "ref"}  # us after ref
    overlaps = t["main_start"] < t["side_end"] and t["side_start"] < t["main_end"]
    return {
        "checked": True,
        "noise_shape": [batch, vocab],
        "us": {k: round(v, 1) for k, v in t.items()},
        "overlaps": overlaps,
        "hidden": overlaps and t["side_end"] <= t["main_end"],
        "passed": overlaps,
    }


# ---- 3. benchmarks ----------------------------------------------------------------------------------


def grammar_like_mask(batch: int, vocab: int, generator):
    """A bitmask as grammars make them: half the rows allow a few scattered tokens (a JSON key, a
    digit), half allow all but a few (inside a string), so most tiles are uniform."""
    import torch

    from logitgate.backends.reference import pack_bitmask

    dev = generator.device
    allowed = torch.rand(batch, vocab, device=dev, generator=generator)
    rows = torch.arange(batch, device=dev).unsqueeze(1)
    return pack_bitmask(torch.where(rows % 2 == 0, allowed < 0.001, allowed > 0.001))


def bench_bitmask(backend, shapes, timer: Timer, repeats: int, progress) -> list[dict]:
    import torch

    from logitgate.backends.reference import pack_bitmask

    rows = []
    dev = backend.device
    cases = [(batch, vocab, dtype, "50% allowed, random") for batch, vocab in shapes["bitmask"]
             for dtype in (torch.float32, torch.bfloat16)]
    cases.append((*shapes["bitmask_grammar"], torch.float32, "grammar-like: rows allow 0.1% or 99.9%"))
    for batch, vocab, dtype, mask in cases:
        dname = str(dtype).removeprefix("torch.")
        progress.step(f"bitmask apply {batch}x{vocab} {dname}, {mask}")
        g = torch.Generator(device=dev).manual_seed(batch)
        source = torch.randn(batch, vocab, device=dev, generator=g).to(dtype)
        if mask.startswith("grammar"):
            bitmask = grammar_like_mask(batch, vocab, g)
        else:
            bitmask = pack_bitmask(torch.rand(batch, vocab, device=dev, generator=g) < 0.5)
        rows.append(bench_bitmask_case(backend, timer, repeats, source, bitmask, mask))
    return rows


def bench_bitmask_case(backend, timer: Timer, repeats: int, source, bitmask, mask: str) -> dict:
    """One shape, dtype and mask: copy, logitgate (each CUDA variant), torch masked_fill, xgrammar."""
    import torch

    import logitgate
    from logitgate.backends.reference import apply_token_bitmask_reference

    try:
        import xgrammar
    except ImportError:
        xgrammar = None
    batch, vocab = source.shape
    dname = str(source.dtype).removeprefix("torch.")
    logits = source.clone()
    expected = source.clone()
    apply_token_bitmask_reference(expected, bitmask, None, vocab)

    def apply():
        logitgate.apply_token_bitmask_inplace(logits, bitmask, backend=backend)

    fns: dict[str, Any] = {
        "copy": lambda: logits.copy_(source),
        "logitgate": in_variant("bitmask", "current", apply),
        "logitgate_v2": in_variant("bitmask", "v2", apply),
        "torch_masked_fill": lambda: apply_token_bitmask_reference(logits, bitmask, None, vocab),
    }
    if xgrammar is not None:
        fns["xgrammar"] = lambda: xgrammar.apply_token_bitmask_inplace(logits, bitmask)
    correct, failed = {}, {}
    for name, fn in list(fns.items()):
        if name == "copy":
            continue
        logits.copy_(source)
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - e.g. a baseline without this dtype: drop it, say why
            failed[name] = f"{type(exc).__name__}: {exc}"
            del fns[name]
            continue
        correct[name] = bool(torch.equal(logits, expected))
    for name in ("logitgate", "logitgate_v2"):
        if name in failed:
            raise RuntimeError(f"logitgate's bitmask apply ({name}) failed at {batch}x{vocab} {dname}: {failed[name]}")
    runs = timed(fns, timer, repeats)
    logit_bytes = source.numel() * source.element_size()
    mask_bytes = bitmask.numel() * 4
    copy_gbps = 2 * logit_bytes / runs["copy"].median / 1e9
    row = {"shape": f"{batch}x{vocab}", "dtype": dname, "mask": mask, "copy_gbps": copy_gbps, "correct": correct,
           "failed": failed, "impl": {}}
    for name, timing in runs.items():
        gbps = (logit_bytes + mask_bytes) / timing.median / 1e9 if name != "copy" else copy_gbps
        row["impl"][name] = {**_us(timing), "gbps": gbps, "fraction_of_copy": gbps / copy_gbps}
    best = min(("logitgate", "logitgate_v2"), key=lambda name: runs[name].median)
    row["speedup_vs_torch_masked_fill"] = runs["torch_masked_fill"].median / runs[best].median
    if "xgrammar" in runs:
        row["speedup_vs_xgrammar"] = runs["xgrammar"].median / runs[best].median
    row["variants"] = variant_summary(runs, correct)
    row["goal_met"] = row["impl"][best]["fraction_of_copy"] >= GOAL_COPY_FRACTION and row.get("speedup_vs_xgrammar", 1.0) >= 1.0
    return row


SAMPLING_CASES = {  # case -> (top_k, top_p) of every row, temperature 1
    "temperature 1, top_k 50, top_p 0.9, random": (50, 0.9),
    "temperature 1, top_p 0.9, random": (0, 0.9),
}


def bench_sampling(backend, shapes, timer: Timer, repeats: int, progress) -> list[dict]:
    import torch

    from bench_sampling import vllm_top_k_top_p_sample
    from logitgate.backends.reference import apply_top_k_top_p_reference, exponential_race
    from logitgate.sampling import Sampler, SamplingMetadata, SamplingParams

    batch, vocab = shapes["sampling"]
    dev = backend.device
    rows = []
    for case, (top_k, top_p) in SAMPLING_CASES.items():
        progress.step(f"sampling {batch}x{vocab}: {case}")
        g = torch.Generator(device=dev).manual_seed(1)
        source = torch.randn(batch, vocab, device=dev, generator=g) * 3
        logits = source.clone()
        params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)] * batch
        metadata = SamplingMetadata.from_params(params, device=dev)
        sampler = Sampler(backend=backend)
        k, p = metadata.top_k, metadata.top_p

        def restore():
            logits.copy_(source)

        def ours():
            metadata.prefetch_noise(batch, vocab, backend=backend)  # as an engine does before the forward pass
            return sampler(logits, metadata).sampled_token_ids

        def sort_reference():
            probs = apply_top_k_top_p_reference(logits, k, p).softmax(dim=-1)
            return exponential_race(probs, torch.empty_like(probs).exponential_())

        fns = {
            "one_read_floor": lambda: source.amax(dim=-1),
            "logitgate": in_variant("sampling", "current", (restore, ours)),
            "logitgate_v2": in_variant("sampling", "v2", (restore, ours)),
            "vllm_torch": (restore, lambda: vllm_top_k_top_p_sample(logits, k, p)),
            "sort_reference": (restore, sort_reference),
        }
        runs = timed(fns, timer, repeats)
        correct = {name: sampler_equals_reference(backend, source, params, variant)
                   for name, variant in (("logitgate", "current"), ("logitgate_v2", "v2"))}
        row = _floor_row(case, f"{batch}x{vocab}", runs)
        row["correct"] = {name: c["equal"] == c["rows"] for name, c in correct.items()}
        row["tokens_equal_to_reference"] = correct
        row["variants"] = variant_summary(runs, row["correct"])
        rows.append(row)
    return rows


def sampler_equals_reference(backend, logits, params, variant: str) -> dict[str, int]:
    """Rows of one Sampler step (this variant, noise prefetched) whose token is the reference's
    draw with the same noise (the (B, V) Exp(1) tensor, or the Philox noise of v2's seeds)."""

    from logitgate.backends.base import NOISE_PHILOX
    from logitgate.backends.reference import sample_from_logits_reference
    from logitgate.backends.variants import selected
    from logitgate.sampling import Sampler, SamplingMetadata

    batch, vocab = logits.shape
    with selected("sampling", variant):
        metadata = SamplingMetadata.from_params(params, device=logits.device)
        metadata.prefetch_noise(batch, vocab, backend=backend)
        noise = metadata.noise
        tokens = Sampler(backend=backend)(logits.clone(), metadata).sampled_token_ids[:, 0].long()
    q = noise.values
    if noise.kind == NOISE_PHILOX:
        from logitgate.backends.triton.philox import philox_exponential_triton

        q = philox_exponential_triton(q, vocab)
    expected = sample_from_logits_reference(logits, metadata.temperature, metadata.top_k, metadata.top_p, q)
    return {"rows": batch, "equal": int((tokens == expected).sum())}


def bench_rejection(backend, shapes, timer: Timer, repeats: int, progress) -> list[dict]:
    import torch

    from bench_rejection import vllm_torch
    from logitgate.sampling.rejection import rejection_sample

    batch, k, vocab = shapes["rejection"]
    dev = backend.device
    progress.step(f"rejection sampling B={batch} k={k} V={vocab}")
    g = torch.Generator(device=dev).manual_seed(2)
    target = torch.randn(batch * k, vocab, device=dev, generator=g) * 2
    draft_probs = torch.softmax(target + torch.randn(batch * k, vocab, device=dev, generator=g) * 0.5, dim=-1)
    drafts = torch.multinomial(draft_probs, 1, generator=g).squeeze(-1)
    bonus = torch.randint(0, vocab, (batch,), device=dev, generator=g)
    temperature = torch.ones(batch, device=dev)
    counts = [k] * batch

    def ours():
        return rejection_sample(drafts, counts, target, bonus, draft_probs=draft_probs, temperature=temperature, backend=backend)

    fns = {
        "one_read_floor": lambda: target.amax(dim=-1),
        "logitgate": in_variant("rejection", "current", ours),
        "logitgate_v2": in_variant("rejection", "v2", ours),
        "vllm_torch": lambda: vllm_torch(drafts, target, bonus, draft_probs, temperature),
    }
    runs = timed(fns, timer, repeats)
    row = _floor_row("random, draft probs (a perturbed copy of the target)", f"B={batch} k={k} V={vocab}", runs)
    check = {name: rejection_equals_reference(backend, drafts, counts, target, bonus, draft_probs, temperature, variant)
             for name, variant in (("logitgate", "current"), ("logitgate_v2", "v2"))}
    row["correct"] = {name: c["equal"] == c["requests"] for name, c in check.items()}
    row["requests_equal_to_reference"] = check
    row["variants"] = variant_summary(runs, row["correct"])
    return [row]


def rejection_equals_reference(backend, drafts, counts, target, bonus, draft_probs, temperature, variant: str) -> dict[str, int]:
    """Requests whose output row is the reference's with the same random numbers: the call is
    replayed from one seed (the uniforms, then the recovery noise: (B, V) Exp(1) or v2's seeds)."""
    import torch

    from logitgate.backends.reference import draw_seeds, rejection_verify_reference
    from logitgate.backends.variants import selected
    from logitgate.sampling.rejection import rejection_sample

    dev = target.device
    with selected("rejection", variant):
        torch.manual_seed(1234)
        out = rejection_sample(drafts, counts, target, bonus, draft_probs=draft_probs, temperature=temperature, backend=backend)
        kind = backend.recovery_noise
    torch.manual_seed(1234)
    uniform = torch.rand(drafts.numel(), dtype=torch.float64, device=dev)
    if kind == "philox":
        from logitgate.backends.triton.philox import philox_exponential_triton

        q = philox_exponential_triton(draw_seeds(len(counts), {}, dev), target.shape[1])
    elif kind == "uniform":  # the CPU's inverse CDF
        q = torch.rand(len(counts), dtype=torch.float64, device=dev)
    else:
        q = torch.empty(len(counts), target.shape[1], device=dev).exponential_()
    cu = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    expected = rejection_verify_reference(cu, drafts, target, temperature, draft_probs, uniform, q, bonus, max(counts) + 1)
    return {"requests": len(counts), "equal": int((out == expected).all(dim=1).sum())}


def _floor_row(case: str, shape: str, runs: dict) -> dict:
    """A result row judged against the one-read floor: logitgate's time over the floor's (the
    goal), and the speedup over every other baseline timed in `runs`."""
    ours = runs["logitgate"].median
    row = {"case": case, "shape": shape, "impl": {name: _us(t) for name, t in runs.items()},
           "vs_one_read_floor": ours / runs["one_read_floor"].median}
    row.update({f"speedup_vs_{name}": t.median / ours for name, t in runs.items()
                if name not in ("logitgate", "logitgate_v2", "one_read_floor")})
    if "logitgate_v2" in runs:
        row["vs_one_read_floor_v2"] = runs["logitgate_v2"].median / runs["one_read_floor"].median
    row["goal_met"] = min(row["vs_one_read_floor"], row.get("vs_one_read_floor_v2", float("inf"))) <= GOAL_FLOOR_RATIO
    return row


def bench_tree(backend, shapes, timer: Timer, repeats: int, progress) -> list[dict]:
    import torch

    import logitgate
    from bench_tree import batch_prefixes, make_catalog, prefix_dict_config
    from logitgate import TreeDFA
    from logitgate.backends.base import CandidateRows

    batch, vocab, items = shapes["tree"]
    dev = backend.device
    from logitgate.backends import reference

    progress.step(f"tree fill, candidates, gather and keep B={batch} V={vocab}, {items} items")
    catalog = make_catalog(items)
    tree = TreeDFA.from_prefix_dict(prefix_dict_config(catalog), vocab_size=vocab, device=dev)
    prefixes = (batch_prefixes(catalog) * (batch // 64 + 1))[:batch]
    states = torch.tensor([tree.walk(p) for p in prefixes], device=dev)
    tokens = torch.full((batch,), 2, device=dev)
    bitmask = logitgate.allocate_token_bitmask(batch, vocab, device=dev)
    logits = torch.randn(batch, vocab, device=dev)

    def dense():
        tree.fill_bitmask(states, bitmask)
        logitgate.apply_token_bitmask_inplace(logits, bitmask, backend=backend)

    def sparse_greedy():
        ids, valid = tree.candidates(states)
        picked = logits.gather(1, ids).masked_fill_(~valid, float("-inf")).argmax(1, keepdim=True)
        return ids.gather(1, picked)

    # The sparse path's kernels (Triton on CUDA) against the torch reference they replace, on one
    # layout of the batch's exact widths; keep works on its own copy of the logits.
    tree_args, width = tree_kernel_args(tree, states)
    kept = logits.clone()
    fill_args = (states, *tree.fill_layout())
    torch_bitmask = bitmask.clone()
    fns = {
        "fill_bitmask": lambda: tree.fill_bitmask(states, bitmask),
        "fill_bitmask_torch": lambda: reference.fill_tree_bitmask_reference(torch_bitmask, *fill_args),
        "fill_and_apply": dense,
        "candidates": lambda: tree.candidates(states),
        "candidates_greedy": sparse_greedy,
        "gather_candidates": lambda: backend.gather_candidate_logits(logits, CandidateRows(*tree_args, width)),
        "gather_candidates_torch": lambda: reference.gather_candidate_logits_reference(logits, *tree_args, width),
        "keep_only_allowed": lambda: backend.keep_candidate_logits(kept, CandidateRows(*tree_args, width)),
        "keep_only_allowed_torch": lambda: reference.keep_candidate_logits_reference(kept, *tree_args, width),
        "advance": lambda: tree.advance(states, tokens),
    }
    runs = timed(fns, timer, repeats)
    ms = {name: t.median for name, t in runs.items()}
    return [{"case": f"{items}-item prefix-dict tree, rows two tokens deep", "shape": f"{batch}x{vocab}",
             "max_width": tree.max_width, "layout_width": width, "impl": {name: _us(t) for name, t in runs.items()},
             "speedup_fill_vs_torch": ms["fill_bitmask_torch"] / ms["fill_bitmask"],
             "speedup_gather_vs_torch": ms["gather_candidates_torch"] / ms["gather_candidates"],
             "speedup_keep_vs_torch": ms["keep_only_allowed_torch"] / ms["keep_only_allowed"],
             "correct": tree_kernels_correct(backend, tree, states, logits, fill_args)}]


def tree_kernel_args(tree, states):
    """(rows, starts, widths, allow_tok) of every row of `states` in one sparse layout, and its
    width (the widest row, read once here, outside any timed or sync-checked part)."""
    import torch

    widths = tree.widths[states].long()
    rows = torch.arange(states.shape[0], device=states.device)
    return (rows, tree.allow_start[states], widths, tree.allow_tok), int(widths.max())


def tree_kernels_correct(backend, tree, states, logits, fill_args) -> dict[str, bool]:
    """The backend's tree kernels equal the torch reference on the benchmark's inputs."""
    import torch

    from logitgate.backends import reference
    from logitgate.backends.base import CandidateRows

    args, width = tree_kernel_args(tree, states)
    got_mask, want_mask = (torch.full((states.shape[0], (logits.shape[1] + 31) // 32), 7, dtype=torch.int32,
                                      device=logits.device) for _ in range(2))
    backend.fill_tree_bitmask(got_mask, *fill_args)
    reference.fill_tree_bitmask_reference(want_mask, *fill_args)
    got_keep, want_keep = logits.clone(), logits.clone()
    backend.keep_candidate_logits(got_keep, CandidateRows(*args, width))
    reference.keep_candidate_logits_reference(want_keep, *args, width)
    gathered = backend.gather_candidate_logits(logits, CandidateRows(*args, width))
    return {"fill_bitmask": torch.equal(got_mask, want_mask),
            "gather_candidates": torch.equal(gathered, reference.gather_candidate_logits_reference(logits, *args, width)),
            "keep_only_allowed": torch.equal(got_keep, want_keep)}


BENCHMARKS = {"bitmask": bench_bitmask, "sampling": bench_sampling, "rejection": bench_rejection, "tree": bench_tree}


# ---- 4. the tests -----------------------------------------------------------------------------------


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and the failing tests (with the first line of their message) of a pytest junit XML."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is not None:
                message = (node.get("message") or node.text or "").strip().splitlines()
                failed.append(f"{case.get('classname')}::{case.get('name')} ({kind}): {message[0][:200] if message else ''}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed}


def run_tests(device: str, pytest_args: list[str], out: Path, timeout_s: float) -> dict[str, Any]:
    env = dict(os.environ, LOGITGATE_DEVICE=device, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env.pop("TRITON_INTERPRET", None)  # native Triton
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH"), env.get("LOGITGATE_GPU_SITE")) if p)
    junit = out / "pytest.xml"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={junit}", *pytest_args]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        log, status = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        log = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        status = "timeout"
    (out / "pytest.log").write_text(log)
    result: dict[str, Any] = {"command": shlex.join(cmd), "exit": status, "seconds": round(time.perf_counter() - start, 1),
                              "log": str(out / "pytest.log")}
    if junit.is_file():
        result.update(parse_junit(junit))
    result["passed_all"] = status == 0
    if status == "timeout":
        result["note"] = f"pytest ran past the {timeout_s:.0f} s left of the budget"
    return result


# ---- report -----------------------------------------------------------------------------------------


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    out = Path(args.out)
    packages = ensure_packages(args.wheels)
    import torch

    from logitgate.backends import get_backend, probe_cuda
    from logitgate.bench.harness import Progress

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


if __name__ == "__main__":
    sys.exit(main())
