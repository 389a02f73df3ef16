"""Bench and check: bitmask apply vs xgrammar's kernel and torch masked_fill, against the copy bandwidth."""
from __future__ import annotations

from typing import Any

from .config import GOAL_COPY_FRACTION
from .timing import Timer, in_variant, timed, us_fields, variant_summary


def grammar_like_mask(batch: int, vocab: int, generator):
    """A bitmask as grammars make them: half the rows allow a few scattered tokens (a JSON key, a
    digit), half allow all but a few (inside a string), so most tiles are uniform."""
    import torch

    from logitgate.backends.formats import pack_bitmask

    dev = generator.device
    allowed = torch.rand(batch, vocab, device=dev, generator=generator)
    rows = torch.arange(batch, device=dev).unsqueeze(1)
    return pack_bitmask(torch.where(rows % 2 == 0, allowed < 0.001, allowed > 0.001))


def bench_bitmask(backend, shapes, timer: Timer, repeats: int, progress) -> list[dict]:
    import torch

    from logitgate.backends.formats import pack_bitmask

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
        row["impl"][name] = {**us_fields(timing), "gbps": gbps, "fraction_of_copy": gbps / copy_gbps}
    best = min(("logitgate", "logitgate_v2"), key=lambda name: runs[name].median)
    row["speedup_vs_torch_masked_fill"] = runs["torch_masked_fill"].median / runs[best].median
    if "xgrammar" in runs:
        row["speedup_vs_xgrammar"] = runs["xgrammar"].median / runs[best].median
    row["variants"] = variant_summary(runs, correct)
    row["goal_met"] = row["impl"][best]["fraction_of_copy"] >= GOAL_COPY_FRACTION and row.get("speedup_vs_xgrammar", 1.0) >= 1.0
    return row
