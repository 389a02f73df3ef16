"""The sync check: one decode step, part by part, under set_sync_debug_mode("error"), and whether
the side stream's noise overlaps main-stream work."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .timing import in_variant
from .tree import tree_kernel_args


def decode_step_parts(backend, shapes: dict) -> dict[str, Callable[[], Any]]:
    """The parts of one decode step, inputs prepared (and uploaded) beforehand as an engine would."""
    import torch

    import logitgate
    from logitgate import TreeDFA
    from logitgate.backends.base import CandidateRows
    from logitgate.sampling import Sampler, SamplingMetadata, SamplingParams
    from logitgate.sampling.rejection import rejection_sample

    from ..tree import batch_prefixes, make_catalog, prefix_dict_config

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
