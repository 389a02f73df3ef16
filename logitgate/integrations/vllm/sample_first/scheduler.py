"""The scheduler's side of `sample_first`: which rows `StructuredOutputManager.grammar_bitmask`
leaves all-ones, and what the worker needs to check them (the package docstring says why it is exact)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from ..replacements import mark_replacement
from . import DeferredRows, row_can_sample_first
from .layout import runner_handles_deferred, runners, why_not_one_cpu_worker

__all__ = ["bitmask_width", "grammar_bitmask_replacement", "update_from_output_replacement", "WORKER_MIRRORS"]

logger = logging.getLogger("vllm.logitgate.sample_first")

LOCAL, MIRRORED = "local", "mirrored"  # where a deferred row is checked: the scheduler's grammar, the worker's mirror
_MIRRORS_KEY = "_logitgate_worker_mirrors"  # on the manager: its worker said it mirrors grammars
_SHIPPED_KEY = "_logitgate_shipped"  # on a request: output tokens already shipped to the worker's mirror
_OFF_LOGGED_KEY = "_logitgate_sample_first_off_logged"  # on the manager: the "off" line was logged
WORKER_MIRRORS = "logitgate_mirrors_grammars"  # on a ModelRunnerOutput: the worker that sampled it mirrors


def _deferral(manager: Any) -> str | None:
    """LOCAL where a runner that handles deferred rows samples in this very process (vLLM's
    in-process executor); MIRRORED where the engine's worker process has said, with a sampled
    output, that it handles them with mirrors of the grammars (and no reasoning parser shifts where
    the grammar starts); None elsewhere: vLLM's fill."""
    why_not = why_not_one_cpu_worker(manager.vllm_config)
    if why_not is not None:
        if not manager.__dict__.get(_OFF_LOGGED_KEY):  # once per engine: the operation is off, and why
            manager.__dict__[_OFF_LOGGED_KEY] = True
            logger.info("logitgate sample_first: off in this engine (%s); rows are masked before sampling, as vLLM does",
                        why_not)
        return None
    if any(runner_handles_deferred(runner) for runner in list(runners)):
        return LOCAL
    if manager.__dict__.get(_MIRRORS_KEY) and getattr(manager, "reasoner_cls", None) is None:
        return MIRRORED
    return None


def bitmask_width(config: Any) -> int:
    """Words of a bitmask row: ceil(V / 32), as vLLM's backends and logitgate's trees allocate it."""
    return (config.model_config.get_vocab_size() + 31) // 32


def _deferrable(manager: Any, request: Any, where: str) -> bool:
    structured = request.structured_output_request
    grammar = getattr(structured, "grammar", None)
    if grammar is None or grammar.is_terminated() or not row_can_sample_first(request.sampling_params):
        return False
    if where == MIRRORED and not request.num_output_tokens:
        return False  # the first token is filled here while the worker compiles its mirror
    bounds = getattr(manager, "_get_constraint_bounds", None)
    # Before the constraint starts (reasoning) the row is all-ones anyway: vLLM's fill handles it.
    return bounds is None or bounds(request, ()).constraint_start == 0


def _entry(request: Any, where: str) -> tuple[Any, float, int, tuple[int, ...]]:
    temperature = request.sampling_params.temperature
    if where == LOCAL:
        return request.structured_output_request.grammar, temperature, 0, ()
    start = request.__dict__.get(_SHIPPED_KEY, 0)
    tokens = tuple(request.output_token_ids[start:])  # what the scheduler's grammar accepted since
    request.__dict__[_SHIPPED_KEY] = start + len(tokens)
    return None, temperature, start, tokens


def grammar_bitmask_replacement(original: Callable, name: str) -> Callable:
    """StructuredOutputManager.grammar_bitmask: vLLM's fill for the rows that need it, all-ones
    rows (and what checks them, for the worker) for the rows that can sample first."""

    def grammar_bitmask(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens):
        where = _deferral(self) if structured_output_request_ids else None
        if where is None:
            return original(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens)
        deferred = {
            req_id: _entry(requests[req_id], where)
            for req_id in structured_output_request_ids
            if _deferrable(self, requests[req_id], where)
        }
        if not deferred:
            return original(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens)
        rows = [i for i, req_id in enumerate(structured_output_request_ids) if req_id not in deferred]
        filled_ids = [structured_output_request_ids[i] for i in rows]
        filled = original(self, requests, filled_ids, scheduled_spec_decode_tokens) if rows else None
        # A server that has seen only tree requests has no grammar backend to ask for the width.
        width = filled.shape[1] if filled is not None else bitmask_width(self.vllm_config)
        bitmask = np.full((len(structured_output_request_ids), width), -1, dtype=np.int32)
        if filled is not None:
            bitmask[rows] = filled
        grammar_bitmask.routed_calls += len(deferred)
        return DeferredRows.wrap(bitmask, deferred)

    return mark_replacement(grammar_bitmask, original, name)


def update_from_output_replacement(original: Callable, name: str) -> Callable:
    """Scheduler.update_from_output: notes that the worker mirrors grammars (its sampled output says
    so), from which step on the manager may defer rows to it."""

    def update_from_output(self, scheduler_output, model_runner_output):
        if getattr(model_runner_output, WORKER_MIRRORS, False) and not self.structured_output_manager.__dict__.get(_MIRRORS_KEY):
            self.structured_output_manager.__dict__[_MIRRORS_KEY] = True
            update_from_output.routed_calls += 1
            logger.info("logitgate sample_first: the worker process checks rows sampled before their masks, "
                        "with its own mirrors of the grammars")
        return original(self, scheduler_output, model_runner_output)

    return mark_replacement(update_from_output, original, name)  # routed_calls: workers found mirroring

