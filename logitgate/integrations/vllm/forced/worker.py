"""The model runner's side of forced drafts: a batch whose requests carry drafts is verified in
its one pass although no speculative config made the runner speculative. Replacement bodies of the
`forced` rows of patches.py for GPUModelRunner (vLLM-CPU's runner inherits them).

vLLM's runner already lays the drafts into the batch's input ids and positions (the scheduler
scheduled them as tokens); only the choice of logits rows is tied to the config: without one it
computes the logits of each request's last position. Here, for a batch with drafts, vLLM's own
_calc_spec_decode_metadata picks every draft position and the bonus position, and the runner's
rejection sampler (vLLM's RejectionSampler, created on first use; its kernels are logitgate's
under `rejection`) verifies them under the masks the scheduler filled. Where sparse.plan_for allows
(also under a user's token drafter, whose config made the runner speculative and whose rejection
sampler is then swapped for the same one with the plan's route), the forward computes the bonus
rows only and the draft positions are computed and verified over the tokens their masks allow
(sparse.py). A batch without drafts is untouched: vLLM's plain sampler, sample_first included.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from ..patching import mark_replacement
from . import max_drafts, sparse
from .proposals import FORCED_IDS, why_not_drafted

__all__ = ["apply_grammar_bitmask_replacement", "execute_model_replacement", "prepare_inputs_replacement"]

_PLAN = "_logitgate_forced_plan"  # on the runner: the sparse plan of the batch being prepared


@functools.cache
def _verifier_class():
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    class Verifier(RejectionSampler):
        """vLLM's rejection sampler; a batch planned sparse is verified over its drafts' allowed
        tokens where it can, by this sampler's own pass elsewhere (sparse.verify)."""

        def forward(self, metadata, draft_probs, logits, sampling_metadata):
            plan = sparse.plan_of(logits)
            if plan is not None:
                def vllm_pass(reduced, full, reduced_sampling):
                    return super(Verifier, self).forward(reduced, None, full, reduced_sampling)

                return sparse.verify(plan, self.sampler, vllm_pass, metadata, logits, sampling_metadata)
            return super().forward(metadata, draft_probs, logits, sampling_metadata)

    return Verifier


def _rejection_sampler(runner):
    """The runner's rejection sampler as a Verifier: created on first use without a speculative
    config; vLLM's own replaced (same sampler and config) under a token drafter's."""
    sampler = getattr(runner, "rejection_sampler", None)
    verifier = _verifier_class()
    if sampler is None:
        sampler = runner.rejection_sampler = verifier(runner.sampler)
    elif not isinstance(sampler, verifier):
        sampler = runner.rejection_sampler = verifier(runner.sampler, runner.speculative_config, runner.device)
    return sampler


def _eligible(runner, num_drafts: np.ndarray, forced_ids: frozenset | None) -> np.ndarray:
    """Per request of the batch: its drafts may be verified over a table (proposals.why_not_drafted:
    no parameter that vLLM's rejection pass applies through its processors; under a user's drafter,
    its drafts are the grammar's: `forced_ids`). Requests without drafts count as eligible: they
    have no rows."""
    batch = runner.input_batch
    eligible = np.ones(len(num_drafts), dtype=bool)
    for i in np.flatnonzero(num_drafts):
        req_id = batch.req_ids[i]
        state = runner.requests.get(req_id)
        eligible[i] = (state is not None and why_not_drafted(state.sampling_params) is None
                       and (forced_ids is None or req_id in forced_ids))
    return eligible


def prepare_inputs_replacement(original: Callable, name: str) -> Callable:
    """GPUModelRunner._prepare_inputs: vLLM's, then speculative metadata for a batch with drafts on a
    runner without a speculative config; where the drafts are computed sparsely (also under a token
    drafter's config, sparse.plan_for) the forward then computes the bonus rows only."""

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        self.__dict__.pop(_PLAN, None)
        logits_indices, metadata, max_sampled = original(self, scheduler_output, num_scheduled_tokens)
        drafted = scheduler_output.scheduled_spec_decode_tokens
        if not drafted:
            return logits_indices, metadata, max_sampled
        forced_ids = getattr(scheduler_output, FORCED_IDS, None)  # under a user's drafter: the grammar's drafts
        if self.speculative_config is not None:  # vLLM laid out the drafts; the plan may narrow its rows
            # A batch with only the drafter's drafts is vLLM's (a plan would compute its rows apart).
            may_hold_forced = (getattr(scheduler_output, "has_structured_output_requests", True) if forced_ids is None
                               else bool(forced_ids))
            if metadata is None or not max_drafts() or not may_hold_forced or not sparse.plan_for(self):
                return logits_indices, metadata, max_sampled
            num_drafts = np.asarray(metadata.num_draft_tokens, dtype=np.int32)
            _rejection_sampler(self)  # vLLM's replaced by the Verifier (same sampler and config)
        elif metadata is not None:
            return logits_indices, metadata, max_sampled
        else:
            batch = self.input_batch
            num_reqs = batch.num_reqs
            num_drafts = np.zeros(num_reqs, dtype=np.int32)
            for req_id, tokens in drafted.items():
                num_drafts[batch.req_id_to_index[req_id]] = len(tokens)
            cu_num_tokens = self.query_start_loc.np[1 : num_reqs + 1]
            metadata = self._calc_spec_decode_metadata(num_drafts, cu_num_tokens)
            logits_indices = metadata.logits_indices
            _rejection_sampler(self)
            _prepare_inputs.routed_calls += 1
            if not sparse.plan_for(self):
                return logits_indices, metadata, int(num_drafts.max()) + 1
        # The forward computes the bonus rows; the draft rows wait for their masks.
        positions = logits_indices[metadata.target_logits_indices]
        setattr(self, _PLAN, (sparse.Plan(self.model, num_drafts, _eligible(self, num_drafts, forced_ids)), positions))
        return logits_indices[metadata.bonus_logits_indices], metadata, int(num_drafts.max()) + 1

    return mark_replacement(_prepare_inputs, original, name)


def execute_model_replacement(original: Callable, name: str) -> Callable:
    """GPUModelRunner.execute_model: vLLM's; a batch planned sparse keeps its draft positions'
    hidden states for the draft rows to be computed when their masks come."""

    def execute_model(self, scheduler_output, *args, **kwargs):
        output = original(self, scheduler_output, *args, **kwargs)
        planned = self.__dict__.pop(_PLAN, None)
        state = self.execute_model_state
        if planned is None or output is not None or state is None:
            return output
        plan, positions = planned
        sparse.track(plan, state.logits, state.hidden_states, positions)
        execute_model.routed_calls += 1
        return output

    return mark_replacement(execute_model, original, name)


def apply_grammar_bitmask_replacement(original: Callable, name: str) -> Callable:
    """The runner's apply_grammar_bitmask: a planned batch's draft rows take their allowed tokens'
    logits from the bitmask; vLLM's masking then applies to its bonus rows (its logits' rows)."""

    def apply_grammar_bitmask(scheduler_output, grammar_output, input_batch, logits):
        plan = sparse.plan_of(logits)
        if plan is not None:
            scheduler_output, grammar_output = sparse.take_masks(plan, logits, scheduler_output, grammar_output,
                                                                 input_batch)
            apply_grammar_bitmask.routed_calls += 1
        return original(scheduler_output, grammar_output, input_batch, logits)

    return mark_replacement(apply_grammar_bitmask, original, name)
