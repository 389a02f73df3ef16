"""The worker's side of `sample_first`: the runner samples the batch, each deferred row's token is
checked against its grammar (the scheduler's own, or this worker's mirror of it), and a rejected row
is settled under its grammar in the same step (redraw.py)."""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..replacements import mark_replacement
from . import row_can_sample_first
from .layout import one_cpu_worker, runner_handles_deferred, runners
from .redraw import choose_again, fill_masks
from .scheduler import WORKER_MIRRORS

__all__ = ["sample_replacement", "sample_tokens_replacement", "sampler_sample_replacement"]

_DEFERRED_KEY = "_logitgate_deferred_rows"
_BUILTIN_PROCESSORS = "vllm.v1.sample.logits_processor.builtin"


def _deferred_of(grammar_output: Any) -> dict[str, tuple[Any, float, int, tuple[int, ...]]]:
    return getattr(getattr(grammar_output, "grammar_bitmask", None), "deferred", None) or {}


_MIRROR_KEY = "_logitgate_mirrors"  # on a runner: its GrammarMirrors, False where it cannot mirror


def _mirrors_of(runner: Any, wanted: bool) -> Any:
    """The runner's mirrors of the scheduler's grammars: made when the first row that needs them
    arrives (`wanted`), never where this runner cannot check deferred rows itself."""
    mirrors = runner.__dict__.get(_MIRROR_KEY)
    if mirrors is None:
        config = getattr(runner, "vllm_config", None)
        if config is None or not runner_handles_deferred(runner) or not one_cpu_worker(config):
            mirrors = runner.__dict__[_MIRROR_KEY] = False
        elif wanted:
            from .mirror import GrammarMirrors

            mirrors = runner.__dict__[_MIRROR_KEY] = GrammarMirrors(config)
    return mirrors if mirrors is not False else None  # (an empty GrammarMirrors is falsy)


def _track_requests(mirrors: Any, runner: Any) -> None:
    """Start the mirrors of this step's new requests that may sample first (their compile runs
    while their first token is filled by the scheduler) and drop the finished ones."""
    state = getattr(runner, "execute_model_state", None)
    scheduler_output = state[0] if isinstance(state, tuple) and state else None
    if scheduler_output is None:
        return
    mirrors.drop(getattr(scheduler_output, "finished_req_ids", ()))
    for new in getattr(scheduler_output, "scheduled_new_reqs", ()):
        if row_can_sample_first(new.sampling_params):
            mirrors.start(new.req_id, new.sampling_params)


def _resolve(runner: Any, deferred: dict, mirrors: Any) -> dict[str, tuple[Any, float]]:
    """Request id -> (grammar, temperature): the scheduler's grammar, or this worker's mirror."""
    resolved = {}
    for req_id, (grammar, temperature, start, tokens) in deferred.items():
        if grammar is None:
            if mirrors is None:  # the scheduler defers to mirrors only after this worker said it has them
                raise RuntimeError(f"logitgate sample_first: request {req_id} was left unmasked for a worker "
                                   "that keeps no grammar mirrors")
            state = runner.requests.get(req_id)
            grammar = mirrors.grammar(req_id, getattr(state, "sampling_params", None), start, tokens)
        resolved[req_id] = (grammar, temperature)
    return resolved


def _without_deferred(grammar_output: Any, deferred: dict) -> Any:
    """The grammar output without the deferred rows (all-ones: applying them changes nothing but
    costs a pass over their logits); None when every row is deferred."""
    ids = getattr(grammar_output, "structured_output_request_ids", None)
    if ids is None or not dataclasses.is_dataclass(grammar_output):
        return grammar_output
    keep = [i for i, req_id in enumerate(ids) if req_id not in deferred]
    if not keep:
        return None
    changes: dict[str, Any] = {"structured_output_request_ids": [ids[i] for i in keep],
                               "grammar_bitmask": np.asarray(grammar_output.grammar_bitmask)[keep]}
    drafts = getattr(grammar_output, "num_acceptable_drafts", None)
    if drafts is not None:
        changes["num_acceptable_drafts"] = [drafts[i] for i in keep]
    return dataclasses.replace(grammar_output, **changes)


def sample_tokens_replacement(original: Callable, name: str) -> Callable:
    """GPUModelRunner.sample_tokens: marks the process as sampling in-process, keeps the worker's
    grammar mirrors (a worker process of its own), hands the deferred rows of this batch to
    `_sample`, and says on its output that it mirrors grammars."""

    def sample_tokens(self, grammar_output):
        runners.add(self)
        deferred = _deferred_of(grammar_output)
        mirrors = _mirrors_of(self, wanted=any(entry[0] is None for entry in deferred.values()))
        if mirrors is not None:
            _track_requests(mirrors, self)
        if deferred:
            self.__dict__[_DEFERRED_KEY] = (_resolve(self, deferred, mirrors), grammar_output.grammar_bitmask.shape[1])
            grammar_output = _without_deferred(grammar_output, deferred)
        try:
            output = original(self, grammar_output)
        finally:
            self.__dict__.pop(_DEFERRED_KEY, None)
        if self.__dict__.get(_MIRROR_KEY) is not False and getattr(output, "req_ids", None):
            setattr(output, WORKER_MIRRORS, True)  # pickled with the output to the scheduler's process
        return output

    return mark_replacement(sample_tokens, original, name)


def _random_rows_exact(input_batch: Any) -> bool:
    """Processors that act on random rows after the temperature (vLLM's argmax-invariant ones)
    are not in the logits `Sampler.sample` receives: only vLLM's min-p may be among them, and
    rows with min-p are never deferred."""
    processors = getattr(input_batch, "logitsprocs", None)
    return processors is None or all(type(p).__module__ == _BUILTIN_PROCESSORS for p in processors.argmax_invariant)


def _vouches(runner: Any) -> bool:
    """Whether this batch's deferred rows can sample first here: the runner's sampler keeps the
    processed logits for a redraw, and nothing the kept logits miss acts on random rows."""
    return runner_handles_deferred(runner) and _random_rows_exact(runner.input_batch)


class _Stash(threading.local):
    rows: list[int] | None = None  # batch rows whose processed logits `Sampler.sample` keeps
    logits: torch.Tensor | None = None


_stash = _Stash()


def sampler_sample_replacement(original: Callable, name: str) -> Callable:
    """Sampler.sample: keeps a copy of the deferred rows' logits as the sampler processed them
    (penalties, bias, logits processors; before the temperature, which it applies in place)."""

    def sample(self, logits, sampling_metadata, *args, **kwargs):
        if _stash.rows is not None:
            every_row = _stash.rows == list(range(logits.shape[0]))
            kept = logits if every_row else logits[_stash.rows]  # a list index copies
            # vLLM's greedy path only reads the logits; otherwise the temperature divides them in place.
            _stash.logits = kept.clone() if every_row and not sampling_metadata.all_greedy else kept
            sample.routed_calls += 1
        return original(self, logits, sampling_metadata, *args, **kwargs)

    return mark_replacement(sample, original, name)


def _mask_rows(logits: torch.Tensor, rows: list[tuple[int, Any]], width: int) -> None:
    """Apply the bitmasks of `rows` ((logits row, grammar)) in place, with the apply function
    vLLM's structured-output utilities use (logitgate's when `bitmask` is on)."""
    from vllm.v1.structured_output import utils

    indices = [row for row, _ in rows]
    packed = torch.full((logits.shape[0], width), -1, dtype=torch.int32)
    packed[indices] = fill_masks([grammar for _, grammar in rows], width)
    utils.xgr.apply_token_bitmask_inplace(logits, packed.to(logits.device), indices=indices)


def sample_replacement(original: Callable, name: str) -> Callable:
    """GPUModelRunner._sample: sample the batch; a deferred row whose token its grammar rejects
    takes the masked argmax of its processed logits (greedy) or a fresh draw from them, over its
    temperature, restricted to what its grammar allows."""

    def _sample(self, logits, spec_decode_metadata):
        pending = self.__dict__.pop(_DEFERRED_KEY, None)
        if pending is None:
            return original(self, logits, spec_decode_metadata)
        deferred, width = pending
        index = self.input_batch.req_id_to_index
        rows = sorted((index[req_id], grammar, temperature)
                      for req_id, (grammar, temperature) in deferred.items() if req_id in index)
        if spec_decode_metadata is not None or not _vouches(self):
            _mask_rows(logits, [(row, grammar) for row, grammar, _ in rows], width)  # as vLLM would
            return original(self, logits, spec_decode_metadata)
        _stash.rows = [row for row, _, _ in rows]
        try:
            output = original(self, logits, None)
            processed = _stash.logits
        finally:
            _stash.rows = _stash.logits = None
        sampled = output.sampled_token_ids[:, 0].tolist()
        rejected = [i for i, (row, grammar, _) in enumerate(rows) if len(grammar.validate_tokens([sampled[row]])) != 1]
        _sample.routed_calls += len(rows) - len(rejected)
        if rejected and processed is None:  # a sampler whose forward never called Sampler.sample
            raise RuntimeError(
                f"logitgate sample_first: {type(self.sampler).__name__} did not pass through Sampler.sample, so "
                f"rows {[rows[i][0] for i in rejected]} cannot be drawn again under their grammars; "
                "leave 'sample_first' out of LOGITGATE_VLLM_OPS with this sampler")
        for row, token in choose_again(processed, rows, rejected, sampled, width).items():
            output.sampled_token_ids[row, 0] = token
        return output

    return mark_replacement(_sample, original, name)
