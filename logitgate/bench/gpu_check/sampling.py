"""Bench and check: top-k/top-p + random sampling vs vLLM's algorithm in torch and the sort-based
reference, and the one-read floor."""
from __future__ import annotations

from .timing import Timer, floor_row, in_variant, timed, variant_summary

SAMPLING_CASES = {  # case -> (top_k, top_p) of every row, temperature 1
    "temperature 1, top_k 50, top_p 0.9, random": (50, 0.9),
    "temperature 1, top_p 0.9, random": (0, 0.9),
}


def bench_sampling(backend, shapes, timer: Timer, repeats: int, progress) -> list[dict]:
    import torch

    from logitgate.backends.reference import apply_top_k_top_p_reference
    from logitgate.backends.sampling_rules import exponential_race
    from logitgate.sampling import Sampler, SamplingMetadata, SamplingParams

    from ..sampling import vllm_top_k_top_p_sample

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
        row = floor_row(case, f"{batch}x{vocab}", runs)
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
