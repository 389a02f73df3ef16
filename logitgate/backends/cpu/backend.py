"""CPU backend: numba kernels, parallel over rows and vocabulary chunks (bitmask) or requests
(rejection sampling)."""
from __future__ import annotations

import functools

import torch

from ..base import NOISE_UNIFORM, Backend, Capabilities, SamplingNoise
from ..reference import gather_candidate_logits_reference, keep_candidate_logits_reference
from ..sampling_rules import draw_uniforms, fallback_tokens
from . import rejection_kernels
from .bitmask_kernels import apply_token_bitmask_cpu
from .sampling_kernels import apply_top_k_cpu, apply_top_p_cpu, argmax_cpu, inverse_cdf_sample_cpu
from .threads import numba_thread_cap, thread_cap


def _capped(method):
    """Run a kernel entry point with at most thread_cap() numba threads: the cores idle when first
    asked (or LOGITGATE_THREADS, or --threads); all cores on a loaded host make every parallel
    region wait for descheduled threads (threads.py)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with numba_thread_cap(thread_cap()):
            return method(self, *args, **kwargs)

    return run


class CpuBackend(Backend):
    name = "cpu"
    recovery_noise = "uniform"  # inverse CDF: one uniform per request instead of V exponentials

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(native_bitmask=True, torch_compile=True, triton=False, side_streams=False)

    def kernels(self) -> dict[str, str]:
        return {
            "apply_token_bitmask": "numba (one masked vector store per word, -1 words skipped; "
            "parallel over rows x 4096-token chunks, serial up to 131k tokens)",
            "rejection_greedy_accept": "numba (per request, argmax only up to the first mismatch)",
            "rejection_random_accept": "numba (per request, one logsumexp per examined row, no softmax written)",
            "rejection_recover": "numba inverse CDF (rejected row only, one uniform per request)",
            "argmax": "numba (integer-key maximum, vectorised; then the first equal element)",
            "random_sample": "inverse CDF, one float64 uniform per row (numba: block sums, then one block)",
            "tree_candidates": "numba (per row: gather its allowed logits, or fill -inf and put them back; greedy: "
            "argmax over a gathered scratch row; random rows: one fused pass per stage over a gathered scratch "
            "row: temperature, top-k, softmax, top-p, inverse CDF)",
            "fill_tree_bitmask": "torch reference (dense rows selected, sparse bits added with scatter_add)",
            "top_k_top_p": "numba (top-k: k-element heap, or bucket selection for k > 512; top-p: 4096-bucket probability histogram, one bucket sorted)",
        }

    @_capped
    def apply_token_bitmask(self, logits, bitmask, rows, vocab_size) -> None:
        apply_token_bitmask_cpu(logits, bitmask, rows, vocab_size)

    @_capped
    def gather_candidate_logits(self, logits, candidates) -> torch.Tensor:
        if logits.dtype != torch.float32:  # numba has no bfloat16
            return gather_candidate_logits_reference(logits, *candidates)
        from .tree_kernels import gather_candidate_logits_cpu

        return gather_candidate_logits_cpu(logits, *candidates)

    # Not @_capped: small batches run a serial kernel, and setting numba's thread count twice per
    # call cost more than a narrow tree's kernel; the parallel kernels cap themselves.
    def candidate_argmax(self, logits, candidates) -> torch.Tensor:
        if logits.dtype != torch.float32 or logits.stride(-1) != 1:
            return super().candidate_argmax(logits, candidates)
        from .tree_kernels import candidate_argmax_cpu

        return candidate_argmax_cpu(logits, *candidates)

    fused_candidate_sampling = True

    def sample_candidates(self, logits, candidates, temperature, greedy, top_k, top_p, uniform):  # capped inside, as candidate_argmax
        if logits.dtype != torch.float32 or logits.stride(-1) != 1:
            return super().sample_candidates(logits, candidates, temperature, greedy, top_k, top_p, uniform)
        from .tree_kernels import sample_candidates_cpu

        return sample_candidates_cpu(logits, *candidates, temperature, greedy, top_k, top_p, uniform)

    @_capped
    def keep_candidate_logits(self, logits, candidates) -> None:
        if logits.dtype != torch.float32:
            keep_candidate_logits_reference(logits, *candidates)
            return
        from .tree_kernels import keep_candidate_logits_cpu

        keep_candidate_logits_cpu(logits, *candidates)

    @_capped
    def rejection_greedy_accept(self, cu_num_draft_tokens, draft_token_ids, target_logits, active):
        return rejection_kernels.greedy_accept_cpu(cu_num_draft_tokens, draft_token_ids, target_logits, active)

    @_capped
    def rejection_random_accept(
        self, cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, uniform, active
    ):
        return rejection_kernels.random_accept_cpu(
            cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, uniform, active
        )

    @_capped
    def rejection_recover(
        self, cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, accepted, row_lse, noise, active
    ):
        return rejection_kernels.recover_cpu(
            cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, accepted, row_lse, noise, active
        )
    # Exponential noise over the whole vocabulary costs more than the rest of a CPU sampling step;
    # an inverse-CDF draw needs one uniform per row.
    @property
    def sampling_noise_kind(self) -> str:
        return NOISE_UNIFORM

    def draw_sampling_noise(self, batch_size, vocab_size, generators) -> SamplingNoise:
        return SamplingNoise(NOISE_UNIFORM, draw_uniforms(batch_size, generators, self.device))

    @_capped
    def random_sample(self, probs, generators, noise) -> torch.Tensor:
        if noise is None:
            noise = self.draw_sampling_noise(probs.shape[0], probs.shape[1], generators)
        return inverse_cdf_sample_cpu(probs, noise.values)

    def undefined_row_fallback(self, scores, undefined):
        # Reading the flags back is free on the host, and saves a pass over the rows when (as
        # always in practice) every row is defined.
        return fallback_tokens(scores) if bool(undefined.any()) else None

    @_capped
    def argmax(self, logits) -> torch.Tensor:
        if logits.dtype != torch.float32 or logits.shape[-1] == 0 or logits.stride(-1) != 1:
            return logits.argmax(dim=-1)
        return argmax_cpu(logits)

    @_capped
    def apply_top_k_top_p(self, logits, k, p, max_top_k) -> torch.Tensor:
        return self.top_k_top_p_probs(logits, k, p, max_top_k)[0]

    @_capped
    def top_k_top_p_probs(self, logits, k, p, max_top_k) -> tuple[torch.Tensor, torch.Tensor]:
        if k is not None:
            apply_top_k_cpu(logits, k)
        probs = logits.softmax(dim=-1)
        if p is not None:
            # The top-p kernel zeroes what it removes in probs too: they are the filtered row's
            # probabilities up to normalisation, and the sampler needs no second softmax.
            apply_top_p_cpu(logits, probs, p)
        return logits, probs
