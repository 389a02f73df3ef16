"""The worker's side of `sample_first`: the runner samples the batch, each deferred row's token is
checked against its grammar (the scheduler's own, or this worker's mirror of it), a rejected row is
settled under its grammar in the same step (redraw.py), and the runner's output carries a report
back to the scheduler: each row's outcome and cost, and the mirrors that compiled or failed."""
from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..kernel_replacements import apply_mask_as_vllm
from ..patching import mark_replacement
from . import min_tokens_pending, validates_as_its_mask
from .layout import one_cpu_worker, runner_handles_deferred, runners
from .mirror import GrammarMirrors, MirrorError
from .protocol import DEFERRED_KEY as _DEFERRED_KEY
from .protocol import MIRRORS_KEY as _MIRROR_KEY
from .protocol import REPORT, Outcome, Report
from .protocol import sampler_stash as _stash
from .redraw import allows, choose_again, fill_masks

__all__ = ["prepare_mirrors", "sample_replacement", "sample_tokens_replacement", "sampler_sample_replacement"]

_BUILTIN_PROCESSORS = "vllm.v1.sample.logits_processor.builtin"
_skips_sample: "weakref.WeakSet[Any]" = weakref.WeakSet()  # runners whose sampler bypassed Sampler.sample


def _mirrors_of(runner: Any) -> GrammarMirrors | None:
    """The runner's mirrors of the scheduler's grammars (made on first use), None where this runner
    cannot check deferred rows itself."""
    mirrors = runner.__dict__.get(_MIRROR_KEY)
    if mirrors is None:
        config = getattr(runner, "vllm_config", None)
        can = config is not None and runner_handles_deferred(runner) and one_cpu_worker(config)
        mirrors = runner.__dict__[_MIRROR_KEY] = GrammarMirrors(config) if can else False
    return None if mirrors is False else mirrors  # (an empty GrammarMirrors is falsy: compare, not test)


def _start_mirrors(mirrors: GrammarMirrors, runner: Any, asked: dict[str, str]) -> None:
    """Drop the mirrors of requests that left the runner; start the ones the scheduler asked for,
    in its grammar backend (they compile in the background)."""
    live = getattr(runner, "requests", {})
    mirrors.keep_only(live)
    for req_id, backend in asked.items():
        state = live.get(req_id)
        if state is not None:
            mirrors.start(req_id, backend, state.sampling_params)


def _has_drafts(runner: Any) -> bool:
    """Whether the batch about to be sampled has drafts (forced/: deferred rows are then only those
    of requests without drafts, each one row)."""
    state = getattr(runner, "execute_model_state", None)
    return bool(state is not None and state.scheduler_output.scheduled_spec_decode_tokens)


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


def prepare_mirrors(runner: Any) -> bool:
    """At the worker's start-up (worker_startup.py): the grammar mirrors' manager built then (its
    tokenizer loaded), never beside the steps of the first structured request
    (mirror.GrammarMirrors.prepare); whether this runner keeps mirrors."""
    mirrors = _mirrors_of(runner)
    if mirrors is None:
        return False
    mirrors.prepare()
    return True


def sample_tokens_replacement(original: Callable, name: str) -> Callable:
    """GPUModelRunner.sample_tokens: marks the process as sampling in-process, keeps the worker's
    grammar mirrors (a worker process of its own), hands the deferred rows of this batch to
    `_sample`, and reports back on its output."""

    def sample_tokens(self, grammar_output):
        runners.add(self)
        bitmask = getattr(grammar_output, "grammar_bitmask", None)
        deferred = getattr(bitmask, "deferred", None) or {}
        mirrors = _mirrors_of(self)
        if mirrors is not None:
            _start_mirrors(mirrors, self, getattr(bitmask, "mirror", None) or {})
        report = Report(mirrors=mirrors is not None)
        if deferred:
            self.__dict__[_DEFERRED_KEY] = (deferred, mirrors, report, bitmask.shape[1])
            if not _has_drafts(self):  # (with drafts a request has several rows: its all-ones row stays)
                grammar_output = _without_deferred(grammar_output, deferred)
        try:
            output = original(self, grammar_output)
        finally:
            self.__dict__.pop(_DEFERRED_KEY, None)
        if getattr(output, "req_ids", None):  # a real output (never vLLM's shared empty one)
            if mirrors is not None:
                report.ready, report.failed = mirrors.settle()
            setattr(output, REPORT, report)  # pickled with the output to the scheduler's process
        return output

    return mark_replacement(sample_tokens, original, name)


def _processors_known(input_batch: Any) -> bool:
    """Only vLLM's own logits processors are in the batch. Processors that act on random rows
    after the temperature (vLLM's argmax-invariant ones) are not in the logits `Sampler.sample`
    receives: only vLLM's min-p may be among them, and rows with min-p are never deferred. Another
    processor may read the masked row, which a deferred row never shows it (vLLM's min-tokens does,
    and its rows are filled first: `_reads_the_mask`)."""
    processors = getattr(input_batch, "logitsprocs", None)
    if processors is None:
        return True
    every = [*processors.argmax_invariant, *getattr(processors, "non_argmax_invariant", ())]
    return all(type(p).__module__ == _BUILTIN_PROCESSORS for p in every)


def _vouches(runner: Any) -> bool:
    """Whether this batch's deferred rows can sample first here: the runner's sampler keeps the
    processed logits for a redraw, and no processor acts on them unseen or reads the mask."""
    return runner not in _skips_sample and runner_handles_deferred(runner) and _processors_known(runner.input_batch)


def _reads_the_mask(runner: Any, req_id: str) -> bool:
    """Whether a logits processor acts on this row's masked logits this step: vLLM's min-tokens,
    which puts a structured row's stop tokens back where the mask and its ban leave nothing (the
    scheduler fills such rows first; this guards a row that reaches the worker anyway)."""
    state = getattr(runner, "requests", {}).get(req_id)
    params = getattr(state, "sampling_params", None)
    return bool(getattr(params, "min_tokens", 0)) and min_tokens_pending(params, len(state.output_token_ids))


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
    indices = [row for row, _ in rows]
    packed = torch.full((logits.shape[0], width), -1, dtype=torch.int32)
    packed[indices] = fill_masks([grammar for _, grammar in rows], width)
    apply_mask_as_vllm(logits, packed.to(logits.device), indices=indices)


def _resolve(deferred: dict, mirrors: GrammarMirrors | None, index: dict[str, int],
             report: Report) -> list[tuple[int, str, Any, float, float]]:
    """(batch row, request id, grammar or None, temperature, seconds) of each deferred row in the
    batch: the scheduler's grammar, or this worker's mirror advanced to it (None, and the row
    reported unchecked, where the mirror cannot follow)."""
    rows = []
    for req_id, (grammar, temperature, start, tokens) in deferred.items():
        if req_id not in index:
            continue
        began = time.perf_counter()
        if grammar is None:
            try:
                if mirrors is None:  # the scheduler defers to mirrors only after this worker said it has them
                    raise MirrorError("this worker keeps no grammar mirrors")
                grammar = mirrors.catch_up(req_id, start, tokens)
            except MirrorError as err:
                report.outcomes[req_id] = Outcome("unchecked", why=str(err))
        rows.append((index[req_id], req_id, grammar, temperature, time.perf_counter() - began))
    return sorted(rows, key=lambda row: row[0])


def sample_replacement(original: Callable, name: str) -> Callable:
    """GPUModelRunner._sample: sample the batch; a deferred row whose token its grammar rejects
    takes the masked argmax of its processed logits (greedy) or an exact draw from them, over its
    temperature, restricted to what its grammar allows (redraw.py); every row's outcome goes in
    the report."""

    def _sample(self, logits, spec_decode_metadata):
        pending = self.__dict__.pop(_DEFERRED_KEY, None)
        if pending is None:
            return original(self, logits, spec_decode_metadata)
        deferred, mirrors, report, width = pending
        rows = _resolve(deferred, mirrors, self.input_batch.req_id_to_index, report)
        # With drafts (forced/), a deferred request's token row is its bonus row, at the state past
        # its drafts: its grammar is advanced there for this step (and rolled back after).
        drafts = _drafts_of(spec_decode_metadata, [row[0] for row in rows if row[2] is not None])
        advanced, rows = _advance(rows, drafts, report)
        try:
            output, accepted = _sample_deferred(self, original, logits, spec_decode_metadata, rows, drafts, report,
                                                width)
        finally:
            for grammar, count in advanced:
                grammar.rollback(count)
        _sample.routed_calls += accepted
        return output

    return mark_replacement(_sample, original, name)


def _sample_deferred(self: Any, original: Callable, logits: torch.Tensor, spec_decode_metadata: Any,
                     rows: list[tuple[int, str, Any, float, float]], drafts: dict[int, list[int]], report: Report,
                     width: int) -> tuple[Any, int]:
    """_sample's work on a batch with deferred rows (each grammar at its row's state): (the
    sampler's output, settled in place; how many deferred rows kept their first draw)."""
    checked = [row for row in rows if row[2] is not None]
    logits_row = _logits_rows(spec_decode_metadata, logits)
    if not _vouches(self):
        first, checked = checked, []
    else:
        reads = [_reads_the_mask(self, row[1]) for row in checked]
        first = [row for row, r in zip(checked, reads) if r]
        checked = [row for row, r in zip(checked, reads) if not r]
    if first:
        began = time.perf_counter()
        _mask_rows(logits, [(logits_row(row), grammar) for row, _, grammar, _, _ in first], width)  # as vLLM would
        each = (time.perf_counter() - began) / len(first)
        report.outcomes.update((req_id, Outcome("filled", each + spent)) for _, req_id, _, _, spent in first)
    if not checked:
        return original(self, logits, spec_decode_metadata), 0
    _stash.rows = [row[0] for row in checked]  # the sampler's rows: one per request (the bonus rows with drafts)
    try:
        output = original(self, logits, spec_decode_metadata)
        processed = _stash.logits
    finally:
        _stash.rows = _stash.logits = None
    # A row's token is in its bonus column (after its drafts); a row whose verification rejected
    # a draft took a token of that draft's masked row instead: nothing of its own to check.
    column = {row[0]: len(drafts.get(row[0], ())) for row in checked}
    tokens = output.sampled_token_ids.tolist()
    reached = [tokens[row[0]][column[row[0]]] >= 0 for row in checked]
    if not all(reached):
        if processed is not None:
            processed = processed[torch.tensor(reached)]
        checked = [row for row, ok in zip(checked, reached) if ok]
    sampled = {row[0]: tokens[row[0]][column[row[0]]] for row in checked}
    masks = _masks_to_check(checked, width)
    rejected = []
    for i, (row, req_id, grammar, _, spent) in enumerate(checked):
        began = time.perf_counter()
        if masks[i] is None:
            accepted = len(grammar.validate_tokens([sampled[row]])) == 1
        else:  # the grammar's own check is not its mask: the mask vLLM would apply decides
            accepted = allows(masks[i][0], sampled[row])
            spent += masks[i][1]
        spent += time.perf_counter() - began
        if accepted:
            report.outcomes[req_id] = Outcome("accepted", spent)
        else:
            rejected.append((i, spent))
    if rejected and processed is None:  # a sampler whose forward never called Sampler.sample
        _skips_sample.add(self)  # from the next step on this runner fills deferred rows before sampling
        why = (f"{type(self.sampler).__name__} did not pass through Sampler.sample, so the row could not be drawn "
               "again under its grammar")
        report.outcomes.update((checked[i][1], Outcome("unchecked", why=why)) for i, _ in rejected)
    elif rejected:
        _redraw(output, processed, checked, rejected, sampled, column, width, report,
                [None if masks[i] is None else masks[i][0] for i, _ in rejected])
    return output, len(checked) - len(rejected)


def _drafts_of(spec_decode_metadata: Any, rows: list[int]) -> dict[int, list[int]]:
    """Batch row -> its draft tokens this step (forced/), for those of `rows` that have any."""
    counts = getattr(spec_decode_metadata, "num_draft_tokens", None)
    if counts is None or not any(counts[row] for row in rows):
        return {}
    tokens = spec_decode_metadata.draft_token_ids.tolist()
    starts = np.concatenate([[0], np.cumsum(counts)])
    return {row: tokens[starts[row] : starts[row] + counts[row]] for row in rows if counts[row]}


def _advance(rows: list[tuple[int, str, Any, float, float]], drafts: dict[int, list[int]],
             report: Report) -> tuple[list[tuple[Any, int]], list[tuple[int, str, Any, float, float]]]:
    """Each drafted row's grammar advanced past its drafts, the state of its bonus row: ((grammar,
    drafts taken) to roll back, the rows). A grammar that refuses its drafts (a mirror out of step:
    the scheduler's grammar filled their masks from the same state) leaves its row unchecked; one
    the drafts end (a stop token among them) has no bonus token to check (vLLM ends the request)."""
    advanced, out = [], []
    for row, req_id, grammar, temperature, spent in rows:
        tokens = drafts.get(row)
        if tokens and grammar is not None:
            began = time.perf_counter()
            if len(grammar.validate_tokens(tokens)) == len(tokens) and grammar.accept_tokens(req_id, tokens):
                advanced.append((grammar, len(tokens)))
                if grammar.is_terminated():  # the drafts end the request (its stop token): no token after them
                    grammar = None
            else:
                report.outcomes[req_id] = Outcome("unchecked", why=f"its grammar refuses its drafts {tokens}")
                grammar = None
            spent += time.perf_counter() - began
        out.append((row, req_id, grammar, temperature, spent))
    return advanced, out


def _logits_rows(spec_decode_metadata: Any, logits: torch.Tensor) -> Callable[[int], int]:
    """Batch row -> its token's logits row: itself without drafts or where the logits have a row per
    request (forced drafts verified sparsely), else its bonus row."""
    if spec_decode_metadata is None or logits.shape[0] == len(spec_decode_metadata.num_draft_tokens):
        return lambda row: row
    bonus = spec_decode_metadata.bonus_logits_indices.tolist()
    return lambda row: bonus[row]


def _masks_to_check(checked: list[tuple[int, str, Any, float, float]],
                    width: int) -> list[tuple[torch.Tensor, float] | None]:
    """Per checked row, (its filled bitmask, seconds per row) where its grammar's validate_tokens
    cannot stand for its mask (llguidance's: sample_first.VALIDATES_AS_MASK), else None. A safety
    net: the scheduler fills such rows first and defers none of them (the package docstring says
    why), but a deferred one that arrives is still checked exactly, as vLLM's mask would."""
    by_mask = [i for i, row in enumerate(checked) if not validates_as_its_mask(row[2])]
    out: list[tuple[torch.Tensor, float] | None] = [None] * len(checked)
    if by_mask:
        began = time.perf_counter()
        bitmask = fill_masks([checked[i][2] for i in by_mask], width)
        each = (time.perf_counter() - began) / len(by_mask)
        for k, i in enumerate(by_mask):
            out[i] = (bitmask[k], each)
    return out


def _redraw(output: Any, processed: torch.Tensor, checked: list[tuple[int, str, Any, float, float]],
            rejected: list[tuple[int, float]], sampled: dict[int, int], column: dict[int, int], width: int,
            report: Report, masks: list[torch.Tensor | None]) -> None:
    """Settle the rejected rows (`rejected`: index into `checked`, seconds so far; `masks`: each
    one's bitmask where already filled) under their grammars, in place on the sampler's output at
    each row's `column`. `processed` holds the checked rows' logits, in order."""
    began = time.perf_counter()
    picks = [i for i, _ in rejected]
    rows = [checked[i] for i in picks]
    values = processed if len(picks) == processed.shape[0] else processed[picks]  # consumed below
    chosen = choose_again(values, [row[2] for row in rows], [row[3] for row in rows],
                          [sampled[row[0]] for row in rows], width, masks=masks)
    each = (time.perf_counter() - began) / len(rows)
    for (row, req_id, _, _, _), (_, spent), (token, how) in zip(rows, rejected, chosen):
        output.sampled_token_ids[row, column[row]] = token
        report.outcomes[req_id] = Outcome(how, spent + each)
