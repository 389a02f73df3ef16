"""The scheduler's side of `sample_first`: which rows `StructuredOutputManager.grammar_bitmask`
leaves all-ones this step (policy.py decides), what the worker needs to check them, and what the
worker's report teaches the policy (the package docstring says why it is exact)."""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import metrics
from ..forced import fill
from ..patching import is_replacement, mark_replacement
from . import min_tokens_pending, row_can_sample_first, validates_as_its_mask
from .layout import runner_handles_deferred, runners, why_not_one_cpu_worker
from .policy import Policy, RowState
from .protocol import BONUS_FREE, REPORT, DeferredRows, Entry, Report

__all__ = ["bonus_may_sample_first", "grammar_bitmask_replacement", "update_from_output_replacement"]

logger = logging.getLogger("vllm.logitgate.sample_first")

LOCAL, MIRRORED = "local", "mirrored"  # where a deferred row is checked: the scheduler's grammar, the worker's mirror
_ENGINE_KEY = "_logitgate_sample_first"  # on the manager: its EngineState
_ROW_KEY = "_logitgate_sample_first"  # on a request: its RowState
# vLLM's grammar backends whose grammars the worker can mirror, by class: the name vLLM's manager takes.
# (llguidance's grammars are filled first all the same: _candidate; a deferred one would be mirrored.)
BACKENDS = {"XgrammarBackend": "xgrammar", "GuidanceBackend": "guidance"}


@dataclasses.dataclass
class EngineState:
    """One manager's part: the policy, whether its worker process keeps mirrors, the bitmask width,
    what was logged once."""

    policy: Policy = dataclasses.field(default_factory=Policy)
    worker_mirrors: bool = False
    width: int | None = None  # words of a bitmask row, as the manager's backend allocates them
    logged: set[str] = dataclasses.field(default_factory=set)

    def log_once(self, key: str, level: int, message: str, *args: Any) -> None:
        if key not in self.logged:
            self.logged.add(key)
            logger.log(level, message, *args)


def engine_state(manager: Any) -> EngineState:
    state = manager.__dict__.get(_ENGINE_KEY)
    if state is None:
        state = manager.__dict__[_ENGINE_KEY] = EngineState()
    return state


def row_state(request: Any) -> RowState:
    state = request.__dict__.get(_ROW_KEY)
    if state is None:
        state = request.__dict__[_ROW_KEY] = RowState()
    return state


def _deferral(manager: Any, state: EngineState) -> str | None:
    """LOCAL where a runner that handles deferred rows samples in this very process (vLLM's
    in-process executor); MIRRORED where the engine's worker process has said, with a sampled
    output, that it keeps mirrors (and no reasoning parser shifts where the grammar starts); None
    elsewhere: vLLM's fill."""
    why_not = why_not_one_cpu_worker(manager.vllm_config)
    if why_not is not None:
        state.log_once("off", logging.INFO, "logitgate sample_first: off in this engine (%s); rows are masked "
                       "before sampling, as vLLM does", why_not)
        return None
    if getattr(getattr(manager.vllm_config, "model_config", None), "logits_processors", None):
        # (the worker masks a batch with one before sampling; deferring would only move the fill there)
        state.log_once("processors", logging.INFO, "logitgate sample_first: off in this engine (custom logits "
                       "processors, which may read the masked row); rows are masked before sampling, as vLLM does")
        return None
    if any(runner_handles_deferred(runner) for runner in list(runners)):
        return LOCAL
    if state.worker_mirrors and getattr(manager, "reasoner_cls", None) is None:
        return MIRRORED
    return None


def defers_rows(manager: Any, request: Any) -> bool:
    """Whether this engine samples `request`'s free rows first (its rows are then deferred, not
    filled): sample_first installed, deferring here, and the request's parameters allow it."""
    if not is_replacement(getattr(type(manager), "grammar_bitmask", None)):
        return False
    return _deferral(manager, engine_state(manager)) is not None and row_can_sample_first(request.sampling_params)


def bonus_may_sample_first(manager: Any, request: Any) -> bool:
    """For a request whose rows this engine defers (defers_rows, which the caller has asked):
    whether its next row would be deferred if it were the bonus row after forced drafts
    (forced/proposals.py ends its drafts by it): the row could sample first, its mirror (across
    processes) is ready, and the policy would not fill it first. Counts nothing down: the decision
    itself is taken when the bitmask is made."""
    state = engine_state(manager)
    if _backend_name(manager, state) is None or _candidate(manager, request) is None:
        return False
    row = row_state(request)
    if _deferral(manager, state) == MIRRORED and row.mirror != "ready":
        return False
    return state.policy.would_sample_first(row)


def _backend_name(manager: Any, state: EngineState) -> str | None:
    """The manager's grammar backend as vLLM names it, where sample_first serves it; else None,
    said once in the log."""
    backend = getattr(manager, "backend", None)
    if backend is None:
        return None  # a server that has seen only tree requests: trees fill first
    name = BACKENDS.get(type(backend).__name__)
    if name is None:
        state.log_once("backend", logging.INFO, "logitgate sample_first: off for the %s grammar backend (its "
                       "grammars are not checked before their masks); bitmask, sampler and fill stay on",
                       type(backend).__name__)
    return name


def _forced(grammar: Any) -> bool:
    """xgrammar knows when the next characters are forced (a JSON key, punctuation): its fill
    costs microseconds there and a draw is likely rejected."""
    matcher = getattr(grammar, "matcher", None)
    return matcher is not None and bool(matcher.find_jump_forward_string())


def _candidate(manager: Any, request: Any) -> Any:
    """The request's grammar where its row could sample first this step, else None."""
    structured = request.structured_output_request
    grammar = getattr(structured, "grammar", None)
    if grammar is None or not getattr(type(grammar), "samples_first", True) or grammar.is_terminated():
        return None  # (trees say samples_first = False: their fill is a row copy)
    if not validates_as_its_mask(grammar):
        # (llguidance's: only its filled mask could check a draw, after the forward pass, where this
        # fill runs beside it: deferring never costs less. Filled first, no mirror asked.)
        return None
    if not row_can_sample_first(request.sampling_params):
        return None
    if min_tokens_pending(request.sampling_params, request.num_output_tokens):
        return None
    bounds = getattr(manager, "_get_constraint_bounds", None)
    # Before the constraint starts (reasoning) the row is all-ones anyway: vLLM's fill handles it.
    return grammar if bounds is None or bounds(request, ()).constraint_start == 0 else None


def _entry(request: Any, grammar: Any, where: str, row: RowState) -> Entry:
    temperature = request.sampling_params.temperature
    if where == LOCAL:
        return grammar, temperature, 0, ()
    start = row.shipped
    tokens = tuple(request.output_token_ids[start:])  # what the scheduler's grammar accepted since
    row.shipped = start + len(tokens)
    return None, temperature, start, tokens


def _width(manager: Any, state: EngineState) -> int:
    """Words of a bitmask row, as the manager's backend allocates them (llguidance sizes by the
    tokenizer, which can be longer than the model's logits)."""
    if state.width is None:
        state.width = int(manager.backend.allocate_token_bitmask(1).shape[1])
    return state.width


def grammar_bitmask_replacement(original: Callable, name: str) -> Callable:
    """StructuredOutputManager.grammar_bitmask: vLLM's fill for the rows that need it, all-ones
    rows (and what checks them, for the worker) for the rows that sample first this step, and the
    requests the worker should start mirroring."""

    def grammar_bitmask(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens):
        state = engine_state(self)
        drafted = scheduled_spec_decode_tokens or {}
        where = _deferral(self, state) if structured_output_request_ids else None
        backend = _backend_name(self, state) if where is not None else None
        if backend is None:
            return _fill(original, self, state, requests, structured_output_request_ids, scheduled_spec_decode_tokens)
        deferred: dict[str, Entry] = {}
        mirror: dict[str, str] = {}
        for req_id in structured_output_request_ids:
            request = requests[req_id]
            drafts = drafted.get(req_id)
            if drafts and not request.__dict__.get(BONUS_FREE):
                continue  # drafts ending inside a forced string (forced/): every row filled by vLLM
            grammar = _candidate(self, request)
            if grammar is None:
                continue
            row = row_state(request)
            if where == MIRRORED and row.mirror != "ready":
                if not row.mirror:  # its row is filled until the worker says the mirror compiled
                    row.mirror = "asked"
                    mirror[req_id] = backend
                    metrics.add("sample_first_mirrors_asked")
                continue
            # (a bonus row after drafts is past the forced string: no forced check of the state before them)
            if state.policy.samples_first(row) and (drafts or not _forced(grammar)):
                deferred[req_id] = _entry(request, grammar, where, row)
        if not deferred and not mirror:
            return _fill(original, self, state, requests, structured_output_request_ids, scheduled_spec_decode_tokens)
        # A request's rows: one per draft, then its bonus row (its only row without drafts). A deferred
        # request's bonus row stays all-ones; its draft rows are vLLM's fill of its drafts but the last
        # (that fill's own bonus row is the mask of the last draft). Only the rows of requests without
        # drafts are timed for the policy, whose fill cost is a free row's: a drafted request's filled
        # rows are forced states (microseconds), and would make every fill look cheap.
        stride = fill.mask_stride(original, self.vllm_config)
        total, rows_of = fill.row_layout(structured_output_request_ids, drafted, stride)
        bitmask = np.full((total, _width(self, state)), -1, dtype=np.int32)
        plain = [req_id for req_id in structured_output_request_ids if req_id not in deferred and not drafted.get(req_id)]
        if plain:
            filled = _timed_fill(original, self, state, requests, plain, {})
            bitmask[rows_of(plain)] = fill.filled_rows(filled, plain, {}, stride)
        with_drafts = [req_id for req_id in structured_output_request_ids if drafted.get(req_id)]
        if with_drafts:
            spec = {req_id: drafted[req_id][:-1] if req_id in deferred else drafted[req_id] for req_id in with_drafts}
            filled = fill.fill_drafted(original, self, requests, with_drafts, spec)
            bitmask[rows_of(with_drafts, set(deferred))] = fill.filled_rows(filled, with_drafts, spec, stride)
        metrics.add("sample_first_rows_deferred", len(deferred))
        metrics.add("sample_first_bonus_rows_deferred", sum(1 for req_id in deferred if drafted.get(req_id)))
        grammar_bitmask.routed_calls += len(deferred)
        return DeferredRows.wrap(bitmask, deferred, mirror)

    return mark_replacement(grammar_bitmask, original, name)


def _fill(original: Callable, manager: Any, state: EngineState, requests: Any, ids: list[str], spec: Any) -> Any:
    """vLLM's fill of the batch, nothing deferred: the requests with forced drafts on forced/fill.py's
    shards, the others timed for the policy. Under a user's drafter vLLM fills every batch serially
    (its parallel path needs no speculative config), and nothing is deferred there: the whole batch
    on forced/fill.py's shards, in parallel under the same rule."""
    if manager.vllm_config.speculative_config is not None:
        return fill.fill_drafted(original, manager, requests, ids, spec or {})
    if not spec:
        return _timed_fill(original, manager, state, requests, ids, spec)
    return fill.grammar_bitmask(original, manager, requests, ids, spec,
                                lambda plain: _timed_fill(original, manager, state, requests, plain, {}))


def _timed_fill(original: Callable, manager: Any, state: EngineState, requests: Any, ids: list[str], spec: Any) -> Any:
    """vLLM's own fill of `ids`, timed for the policy (seconds per filled row; the fill's metrics
    are fill_ahead's)."""
    if not ids:
        return original(manager, requests, ids, spec)
    start = time.perf_counter()
    out = original(manager, requests, ids, spec)
    state.policy.costs.record_fill(time.perf_counter() - start, len(ids))
    return out


def take_report(manager: Any, requests: dict[str, Any], report: Report) -> None:
    """What the worker's report teaches the scheduler: that the worker mirrors, which mirrors are
    ready or failed, and each deferred row's outcome and cost."""
    state = engine_state(manager)
    if report.mirrors and not state.worker_mirrors:
        state.worker_mirrors = True
        logger.info("logitgate sample_first: the worker process checks rows sampled before their masks, "
                    "with its own mirrors of the grammars")
    for req_id in report.ready:
        if req_id in requests:
            row_state(requests[req_id]).mirror = "ready"
    for req_id, why in report.failed.items():
        metrics.add("sample_first_mirrors_failed")
        logger.warning("logitgate sample_first: the worker could not mirror the grammar of request %s (%s); "
                       "its rows are filled by the scheduler", req_id, why)
        if req_id in requests:
            row_state(requests[req_id]).mirror = "failed"
    policy = state.policy
    for req_id, outcome in report.outcomes.items():
        metrics.add(f"sample_first_rows_{outcome.how}")
        metrics.add("sample_first_check_seconds" if outcome.how == "accepted" else "sample_first_settle_seconds",
                    outcome.seconds)
        request = requests.get(req_id)
        if outcome.how == "unchecked":
            logger.error("logitgate sample_first: request %s: %s; its token is checked by the scheduler's grammar "
                         "alone, and its rows are filled from now on", req_id, outcome.why)
            if request is not None:
                row_state(request).mirror = "failed"
            continue
        accepted = outcome.how == "accepted"
        if accepted:
            policy.costs.record_check(outcome.seconds)
        else:
            policy.costs.record_rejection(outcome.seconds)
        if request is not None:
            policy.record(row_state(request), accepted)


def update_from_output_replacement(original: Callable, name: str) -> Callable:
    """Scheduler.update_from_output: takes the worker's report (mirrors, outcomes) before vLLM
    accepts the sampled tokens into its grammars."""

    def update_from_output(self, scheduler_output, model_runner_output):
        report = getattr(model_runner_output, REPORT, None)
        if report is not None:
            take_report(self.structured_output_manager, self.requests, report)
            update_from_output.routed_calls += 1
        return original(self, scheduler_output, model_runner_output)

    return mark_replacement(update_from_output, original, name)  # routed_calls: reports taken
