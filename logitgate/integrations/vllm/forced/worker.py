"""The model runner's side of forced drafts: a batch whose requests carry drafts is verified in
its one pass although no speculative config made the runner speculative. Replacement body of the
`forced` row of patches.py for GPUModelRunner._prepare_inputs (vLLM-CPU's runner inherits it).

vLLM's runner already lays the drafts into the batch's input ids and positions (the scheduler
scheduled them as tokens); only the choice of logits rows is tied to the config: without one it
computes the logits of each request's last position. Here, for a batch with drafts, vLLM's own
_calc_spec_decode_metadata picks every draft position and the bonus position, and the runner's
rejection sampler (vLLM's RejectionSampler, created on first use; its kernels are logitgate's
under `rejection`) verifies them under the masks the scheduler filled. A batch without drafts is
untouched: vLLM's plain sampler, sample_first included.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..patching import mark_replacement

__all__ = ["prepare_inputs_replacement"]


def _rejection_sampler(runner):
    sampler = getattr(runner, "rejection_sampler", None)
    if sampler is None:
        from vllm.v1.sample.rejection_sampler import RejectionSampler

        sampler = runner.rejection_sampler = RejectionSampler(runner.sampler)
    return sampler


def prepare_inputs_replacement(original: Callable, name: str) -> Callable:
    """GPUModelRunner._prepare_inputs: vLLM's, then speculative metadata for a batch with drafts on a
    runner without a speculative config."""

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        logits_indices, metadata, max_sampled = original(self, scheduler_output, num_scheduled_tokens)
        drafted = scheduler_output.scheduled_spec_decode_tokens
        if metadata is not None or not drafted or self.speculative_config is not None:
            return logits_indices, metadata, max_sampled
        batch = self.input_batch
        num_reqs = batch.num_reqs
        num_drafts = np.zeros(num_reqs, dtype=np.int32)
        for req_id, tokens in drafted.items():
            num_drafts[batch.req_id_to_index[req_id]] = len(tokens)
        cu_num_tokens = self.query_start_loc.np[1 : num_reqs + 1]
        metadata = self._calc_spec_decode_metadata(num_drafts, cu_num_tokens)
        _rejection_sampler(self)
        _prepare_inputs.routed_calls += 1
        return metadata.logits_indices, metadata, int(num_drafts.max()) + 1

    return mark_replacement(_prepare_inputs, original, name)
