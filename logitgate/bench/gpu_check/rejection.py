"""Bench and check: rejection sampling vs vLLM's algorithm in torch and the one-read floor."""
from __future__ import annotations

from .timing import Timer, floor_row, in_variant, timed, variant_summary


def bench_rejection(backend, shapes, timer: Timer, repeats: int, progress) -> list[dict]:
    import torch

    from logitgate.sampling.rejection import rejection_sample

    from ..rejection import vllm_torch

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
    row = floor_row("random, draft probs (a perturbed copy of the target)", f"B={batch} k={k} V={vocab}", runs)
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

    from logitgate.backends.reference import rejection_verify_reference
    from logitgate.backends.sampling_rules import draw_seeds
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
