"""CPU backend: numba kernels, parallel over rows and vocabulary chunks (bitmask) or requests
(rejection sampling)."""
from __future__ import annotations

import torch

from . import cpu_rejection
from .base import Backend, Capabilities
from .cpu_kernels import apply_token_bitmask_cpu


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
            "apply_token_bitmask": "numba (parallel over rows x 4096-token chunks, -1 words skipped)",
            "rejection_greedy_accept": "numba (per request, argmax only up to the first mismatch)",
            "rejection_random_accept": "numba (per request, one logsumexp per examined row, no softmax written)",
            "rejection_recover": "numba inverse CDF (rejected row only, one uniform per request)",
        }

    def apply_token_bitmask(self, logits, bitmask, rows, vocab_size) -> None:
        apply_token_bitmask_cpu(logits, bitmask, rows, vocab_size)

    def rejection_greedy_accept(self, cu_num_draft_tokens, draft_token_ids, target_logits, active):
        return cpu_rejection.greedy_accept_cpu(cu_num_draft_tokens, draft_token_ids, target_logits, active)

    def rejection_random_accept(
        self, cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, uniform, active
    ):
        return cpu_rejection.random_accept_cpu(
            cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, uniform, active
        )

    def rejection_recover(
        self, cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, accepted, row_lse, noise, active
    ):
        return cpu_rejection.recover_cpu(
            cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, accepted, row_lse, noise, active
        )
