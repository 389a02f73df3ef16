"""Rejection-sampling kernels through Triton, for the backends that run Triton (CUDA, Ascend).

A mixin so CUDA and NPU share the dispatch and differ only in launch sizing (`_rejection_launch`);
where Triton is unavailable the Backend defaults (the torch reference) run instead.
"""
from __future__ import annotations

from typing import Any

# Bytes of unified buffer one vocabulary lane of each kernel holds (float32 values, indices and
# predicates), which bounds the Ascend tile; see ascend_vocab_tile.
GREEDY_BYTES_PER_TOKEN = 4 + 4 + 1 + 4
ACCEPT_BYTES_PER_TOKEN = 4 + 4 + 4
RECOVER_BYTES_PER_TOKEN = 8 * 4


class TritonRejectionMixin:
    def _rejection_uses_triton(self) -> bool:
        raise NotImplementedError

    def _rejection_launch(self, batch_size: int, bytes_per_token: int) -> dict[str, Any]:
        """grid, requests_per_program and block_v for a per-request kernel."""
        raise NotImplementedError

    def _rejection_kernel_names(self) -> dict[str, str]:
        if not self._rejection_uses_triton():
            return {op: "torch reference" for op in ("rejection_greedy_accept", "rejection_random_accept", "rejection_recover")}
        return {
            "rejection_greedy_accept": "triton (per request, tiled argmax up to the first mismatch)",
            "rejection_random_accept": "triton (per request, online logsumexp per examined row)",
            "rejection_recover": "triton exponential race (rejected row only)",
        }

    def rejection_greedy_accept(self, cu_num_draft_tokens, draft_token_ids, target_logits, active):
        if not self._rejection_uses_triton():
            return super().rejection_greedy_accept(cu_num_draft_tokens, draft_token_ids, target_logits, active)
        self.check_on_device(
            cu_num_draft_tokens=cu_num_draft_tokens, draft_token_ids=draft_token_ids, target_logits=target_logits, active=active
        )
        from .rejection import greedy_accept_triton

        launch = self._rejection_launch(cu_num_draft_tokens.numel(), GREEDY_BYTES_PER_TOKEN)
        return greedy_accept_triton(cu_num_draft_tokens, draft_token_ids, target_logits, active, **launch)

    def rejection_random_accept(
        self, cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, uniform, active
    ):
        if not self._rejection_uses_triton():
            return super().rejection_random_accept(
                cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, uniform, active
            )
        self.check_on_device(
            cu_num_draft_tokens=cu_num_draft_tokens, draft_token_ids=draft_token_ids, target_logits=target_logits,
            temperature=temperature, draft_probs=draft_probs, uniform=uniform, active=active,
        )
        from .rejection import random_accept_triton

        launch = self._rejection_launch(cu_num_draft_tokens.numel(), ACCEPT_BYTES_PER_TOKEN)
        return random_accept_triton(
            cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, uniform, active, **launch
        )

    def rejection_recover(
        self, cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, accepted, row_lse, noise, active
    ):
        if not self._rejection_uses_triton():
            return super().rejection_recover(
                cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, accepted, row_lse, noise, active
            )
        self.check_on_device(
            cu_num_draft_tokens=cu_num_draft_tokens, draft_token_ids=draft_token_ids, target_logits=target_logits,
            temperature=temperature, draft_probs=draft_probs, accepted=accepted, row_lse=row_lse, noise=noise, active=active,
        )
        from .rejection import recover_triton

        launch = self._rejection_launch(cu_num_draft_tokens.numel(), RECOVER_BYTES_PER_TOKEN)
        return recover_triton(
            cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, accepted, row_lse, noise,
            active, **launch,
        )
