"""The scheduler's side of forced drafts (engine core): proposing them, making room for their mask
rows, and counting their outcome. Replacement bodies of the `forced` rows of patches.py.

- StructuredOutputManager.accept_tokens: after the step's tokens advanced a request's grammar, its
  forced tokens become its spec_token_ids (vLLM's schedule() reads them as drafts).
- Scheduler._update_after_schedule: a batch with drafts and no server-wide speculative config
  needs a mask row per draft position; under a user's drafter, the batch's output names the
  requests whose drafts are forced tokens (proposals.FORCED_IDS), for the runner's plan. The
  manager's grammar_bitmask (sample_first's replacement) fills the drafted requests on bitmasks of
  their own (forced/fill.py); only where vLLM's own method would meet the drafts (that replacement
  not installed) is its bitmask made large enough and its parallel fill, which writes one row per
  request, turned off while drafts run.
- Scheduler.make_spec_decoding_stats: counts accepted forced drafts (logitgate_forced_*), and
  without a speculative config reports no speculative stats to vLLM (its SpecDecodingStats are
  sized by the configured draft count, 0 here).
- Scheduler.update_draft_token_ids (a user's drafter): the drafter's tokens (checked against the
  grammar) stand; the grammar's forced tokens replace them where they are more.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from .. import metrics
from ..patching import is_replacement, mark_replacement
from ..sample_first.protocol import BONUS_FREE
from . import max_drafts, proposals
from .fill import new_bitmask

__all__ = ["accept_tokens_replacement", "make_spec_decoding_stats_replacement", "update_after_schedule_replacement",
           "update_draft_token_ids_replacement"]

_SAVED_THRESHOLD = "_logitgate_forced_fill_threshold"  # the manager's parallel-fill threshold while drafts run
_ENCODE = "_logitgate_forced_encode"  # the manager's str -> token ids (its tokenizer, no special tokens)


def _encode(manager: Any) -> Callable[[str], list[int]] | None:
    encode = manager.__dict__.get(_ENCODE)
    if encode is None:
        tokenizer = getattr(manager, "tokenizer", None)
        if tokenizer is None:
            return None

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        setattr(manager, _ENCODE, encode)
    return encode


def accept_tokens_replacement(original: Callable, name: str) -> Callable:
    """StructuredOutputManager.accept_tokens: vLLM's, then the request's forced tokens proposed."""

    def accept_tokens(self, request, new_token_ids):
        accepted = original(self, request, new_token_ids)
        drafts = max_drafts()
        if accepted and new_token_ids and drafts:
            tokens = proposals.propose(self, request, drafts, _encode(self))
            if tokens:
                request.spec_token_ids = tokens
                accept_tokens.routed_calls += 1
        return accepted

    return mark_replacement(accept_tokens, original, name)


def _make_room(manager: Any, rows: int) -> None:
    """A bitmask of at least `rows` rows on the manager (vLLM's own allocation otherwise sizes it
    by the configured draft count)."""
    bitmask = manager._grammar_bitmask
    if bitmask is None or bitmask.shape[0] < rows:
        manager._grammar_bitmask = new_bitmask(manager, rows)


def _vllm_fills_drafts(manager: Any) -> bool:
    """Whether vLLM's own grammar_bitmask fills a drafted batch: sample_first's replacement (which
    hands drafted requests to forced/fill.py) is not installed (LOGITGATE_VLLM_OPS without it)."""
    return not is_replacement(type(manager).grammar_bitmask)


def update_after_schedule_replacement(original: Callable, name: str) -> Callable:
    """Scheduler._update_after_schedule: vLLM's, then, where vLLM's own fill would meet this batch's
    drafts, a bitmask with a row per draft and vLLM's serial fill."""

    def _update_after_schedule(self, scheduler_output):
        original(self, scheduler_output)
        manager = self.structured_output_manager
        if self.vllm_config.speculative_config is not None:  # which drafts are the grammar's, for the runner
            setattr(scheduler_output, proposals.FORCED_IDS, frozenset(
                req_id for req_id in scheduler_output.scheduled_spec_decode_tokens
                if proposals.MARK in getattr(self.requests.get(req_id), "__dict__", {})))
            return
        drafted = scheduler_output.scheduled_spec_decode_tokens
        saved = manager.__dict__.get(_SAVED_THRESHOLD)
        if drafted:
            _update_after_schedule.routed_calls += 1
            if not _vllm_fills_drafts(manager):
                return  # forced/fill.py fills the drafted requests on bitmasks of their own
            seqs = self.vllm_config.scheduler_config.max_num_seqs
            _make_room(manager, max(seqs * (1 + max_drafts()), seqs + sum(len(tokens) for tokens in drafted.values())))
            if saved is None and hasattr(manager, "fill_bitmask_parallel_threshold"):
                setattr(manager, _SAVED_THRESHOLD, manager.fill_bitmask_parallel_threshold)
                manager.fill_bitmask_parallel_threshold = sys.maxsize  # vLLM's serial fill writes the draft rows
        elif saved is not None:
            manager.fill_bitmask_parallel_threshold = saved
            del manager.__dict__[_SAVED_THRESHOLD]

    return mark_replacement(_update_after_schedule, original, name)


def make_spec_decoding_stats_replacement(original: Callable, name: str) -> Callable:
    """Scheduler.make_spec_decoding_stats: forced drafts counted; vLLM's stats only under its own
    speculative config."""

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        proposals.count_verified(self.requests.get(request_id), num_draft_tokens, num_accepted_tokens,
                                 self.structured_output_manager)
        if self.vllm_config.speculative_config is None:
            return spec_decoding_stats
        return original(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                        num_invalid_spec_tokens, request_id)

    return mark_replacement(make_spec_decoding_stats, original, name)


def update_draft_token_ids_replacement(original: Callable, name: str) -> Callable:
    """Scheduler.update_draft_token_ids: a user's drafter's tokens (vLLM's, checked against each
    request's grammar) stand; a request whose grammar fixes more tokens than its drafter proposed
    (proposed in accept_tokens, just before) takes the forced tokens instead. A drafter that
    predicts a request well (an n-gram drafter on a model that repeats itself: 2.8 tokens a request
    a step) proposes as many as the grammar fixes, and its drafts are as valid; forced tokens put in
    their place ran the random model at 0.81-0.98x the drafter alone (at 0.83-0.88x when they won
    ties), where a diffuse model takes other tokenizations of the forced string."""

    def update_draft_token_ids(self, draft_token_ids):
        forced = {}
        for req_id in draft_token_ids.req_ids:
            request = self.requests.get(req_id)
            if request is not None and proposals.MARK in request.__dict__ and request.spec_token_ids:
                forced[req_id] = list(request.spec_token_ids)
        original(self, draft_token_ids)
        kept = 0
        for req_id, tokens in forced.items():
            request = self.requests[req_id]
            if len(request.spec_token_ids) >= len(tokens):
                request.__dict__.pop(proposals.MARK)  # the drafter's drafts: not counted as forced
                request.__dict__.pop(BONUS_FREE, None)
                metrics.add("forced_drafter_preferred")
                continue
            request.spec_token_ids = tokens
            kept += 1
        update_draft_token_ids.routed_calls += kept

    return mark_replacement(update_draft_token_ids, original, name)
