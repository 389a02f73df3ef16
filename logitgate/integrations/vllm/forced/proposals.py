"""Which tokens a structured request proposes as forced drafts this step, and which requests
propose none (they decode one token per pass, exactly as in vLLM).

Runs in the scheduler's process (engine core), right after the step's tokens advanced the
request's grammar (scheduler.accept_tokens_replacement). The tokens come from the constraint's own
code (logitgate/structured/forced.py for xgrammar and llguidance, the tree cursor for trees); this
module only says which grammar a request has, caps the count, and keeps the count of what it
proposed for the acceptance counters.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from .. import metrics
from ..sample_first.protocol import BONUS_FREE
from . import fill

__all__ = ["BACKENDS", "SchemaTallies", "accepts_enough", "backend_of", "drafter_writes_drafts", "forced_for", "propose",
           "schema_tallies", "why_not_drafted"]

BACKENDS = ("xgrammar", "guidance", "tree")
logger = logging.getLogger("vllm.logitgate.forced")
_logged: set[str] = set()


def _log_once(key: str, message: str) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info("%s", message)


MARK = "_logitgate_forced"  # on vLLM's Request: (backend, tokens) of the drafts proposed last
# On vLLM's SchedulerOutput under a user's drafter: the ids of the requests whose drafts are the
# grammar's forced tokens (the runner plans a table for those only; the drafter's rows stay whole).
FORCED_IDS = "_logitgate_forced_ids"
TALLY = "_logitgate_forced_tally"  # on vLLM's Request: [its forced drafts verified, accepted]
# A request whose forced drafts the model accepts less than this often stops proposing them once
# PROBATION of them were verified: a rejected draft costs its mask row's fill and leaves the rows
# after it (the bonus row's, a free state's, the costly fill) filled for nothing. A model trained on
# the schema accepts 85-90% of them; a diffuse one picks other tokenizations of the forced string
# (31% accepted on the random benchmark model, where drafting ran a server at 0.77-0.98x).
MIN_ACCEPTANCE = 0.5
PROBATION = 8
# Each request served its own probation, so a diffuse model paid 2-3 steps of rejected drafts (and
# their rows' fills) for every request of a schema it never follows. A schema's requests are
# counted together (SchemaTallies, one per engine): once SCHEMA_PROBATION of its forced drafts were
# verified below MIN_ACCEPTANCE, its next requests start stopped, all but one in PROBE_EVERY, which
# probe as before and keep the count current (it halves past SCHEMA_WINDOW drafts: recent requests
# weigh most), so a schema the model learns to follow resumes.
SCHEMA_PROBATION = 32
PROBE_EVERY = 16
SCHEMA_WINDOW = 512
MAX_SCHEMAS = 1024  # schemas remembered per engine, the least recently counted forgotten first
SCHEMAS = "_logitgate_forced_schemas"  # on vLLM's StructuredOutputManager: its SchemaTallies
_ENDS_FREE = "_logitgate_ends_free"  # on an xgrammar grammar: it may end where several tokens are allowed


def why_not_drafted(params: Any) -> str | None:
    """None when a request's sampling parameters let its forced tokens be verified as drafts with
    vLLM's output unchanged; else why not (the row then decodes one token per pass). Left out:
    parameters vLLM's rejection path does not apply at draft positions as its sampler does
    (min_p, logit_bias, allowed / bad words, penalties), logprobs (vLLM's would then come from the
    verification pass), a seed (its generator would be drawn in another order than vLLM's: the
    same seed would give other tokens than vLLM alone) and ignore_eos."""
    if params is None:
        return "no sampling parameters (pooling)"
    checks = (
        (params.min_p, "min_p"), (params.logit_bias, "logit_bias"), (params.allowed_token_ids, "allowed_token_ids"),
        (params.bad_words, "bad_words"), (params.presence_penalty, "presence_penalty"),
        (params.frequency_penalty, "frequency_penalty"), (params.repetition_penalty != 1.0, "repetition_penalty"),
        (params.logprobs is not None, "logprobs"), (params.prompt_logprobs is not None, "prompt_logprobs"),
        (params.seed is not None, "seed"), (params.ignore_eos, "ignore_eos"),
    )
    for value, name in checks:
        if value:
            return name
    return None


def backend_of(grammar: Any) -> str | None:
    """"xgrammar", "guidance", "tree" (BACKENDS) by the grammar object vLLM's manager holds; None
    for any other (outlines, lm-format-enforcer: not drafted)."""
    if hasattr(grammar, "walk"):
        return "tree"
    if hasattr(grammar, "ll_matcher"):
        return "guidance"
    if hasattr(grammar, "matcher") and hasattr(grammar, "ctx"):
        return "xgrammar"
    return None


def forced_for(backend: str, grammar: Any, encode: Any, limit: int, last_token: str = "keep") -> list[int]:
    """At most `limit` tokens `grammar` fixes next (mask-forced first, then the canonical
    tokenization of a forced string, its last token left out with last_token="drop"); the grammar
    is left as it was."""
    if grammar.is_terminated():
        return []
    if backend == "tree":
        return grammar.walk.forced_tokens(limit)
    from ....structured import forced

    if backend == "guidance":
        return forced.llguidance_forced_tokens(grammar.ll_matcher, limit).tokens
    # The mask is filled only where no string is fixed and the grammar may end (the stop token after
    # a JSON object, mask-forced: a pass saved per request); a grammar that can end at free states
    # (a fill that allowed several tokens) is not asked again, so it costs one fill, not one a step.
    vocab_size = None if grammar.__dict__.get(_ENDS_FREE) else getattr(grammar, "vocab_size", None)
    found = forced.xgrammar_forced_tokens(grammar.matcher, encode, limit, vocab_size=vocab_size, last_token=last_token)
    if found.ends_free:
        grammar.__dict__[_ENDS_FREE] = True
    return found.tokens


def last_token_rule(manager: Any, request: Any) -> str:
    """How a forced string's drafts end: "keep" its last token where every row is filled anyway
    (GPU and NPU hosts) or where the engine samples free rows first and would defer this request's
    next row (sample_first): the bonus row after the string is then a free state, deferred past
    the drafts like any free row. "drop" where the engine samples first but would fill that row
    (its mirror not ready, the policy filling it): a free bonus row would cost a fill (the costly
    kind, inside a string value) that ending one token short avoids, the bonus row then inside the
    string (a fill of microseconds) and the free row left to the next step (docs/benchmarks.md)."""
    from ..sample_first.scheduler import bonus_may_sample_first, defers_rows

    if not defers_rows(manager, request):
        return "keep"
    return "keep" if bonus_may_sample_first(manager, request) else "drop"


class SchemaTallies:
    """Per schema (vLLM's structured_output_key): [forced drafts verified, accepted, requests
    started] over the engine's requests."""

    def __init__(self) -> None:
        self._tallies: OrderedDict[Any, list[int]] = OrderedDict()

    def add(self, key: Any, verified: int, accepted: int) -> None:
        tally = self._tallies.setdefault(key, [0, 0, 0])
        self._tallies.move_to_end(key)
        tally[0] += verified
        tally[1] += accepted
        if tally[0] > SCHEMA_WINDOW:
            tally[0], tally[1] = tally[0] // 2, tally[1] // 2
        while len(self._tallies) > MAX_SCHEMAS:
            self._tallies.popitem(last=False)

    def start_request(self, key: Any) -> bool:
        """Counts a new request of `key` (for the schema's turns to probe) and says whether it
        starts without proposing forced drafts: its schema's are mostly rejected, and it is not
        this request's turn to probe."""
        tally = self._tallies.get(key)
        if tally is None:
            return False
        tally[2] += 1
        verified, accepted = tally[0], tally[1]
        return verified >= SCHEMA_PROBATION and accepted < MIN_ACCEPTANCE * verified and tally[2] % PROBE_EVERY != 0

    def __len__(self) -> int:
        return len(self._tallies)


def schema_tallies(manager: Any) -> SchemaTallies:
    """The engine's SchemaTallies (on its structured-output manager)."""
    tallies = manager.__dict__.get(SCHEMAS)
    if tallies is None:
        tallies = SchemaTallies()
        setattr(manager, SCHEMAS, tallies)
    return tallies


def _schema_key(request: Any) -> Any:
    structured = getattr(request, "structured_output_request", None)
    return getattr(structured, "structured_output_key", None) if structured is not None else None


def _start(manager: Any, request: Any) -> None:
    """A request's first proposal: it starts stopped where its schema's forced drafts are mostly
    rejected (SchemaTallies), with a tally that says so (accepts_enough)."""
    key = _schema_key(request)
    stopped = key is not None and schema_tallies(manager).start_request(key)
    request.__dict__[TALLY] = [PROBATION, 0] if stopped else [0, 0]
    if stopped:
        metrics.add("forced_requests_stopped")


def accepts_enough(request: Any) -> bool:
    """Whether `request` still proposes forced drafts: fewer than PROBATION of them verified yet,
    or at least MIN_ACCEPTANCE of those accepted."""
    verified, accepted = request.__dict__.get(TALLY, (0, 0))
    return verified < PROBATION or accepted >= MIN_ACCEPTANCE * verified


def drafter_writes_drafts(config: Any) -> bool:
    """Whether a user's drafter runs under async scheduling (EAGLE, MTP, draft models, the GPU
    n-gram): the worker then writes its own drafts over the scheduled ones (vLLM's
    update_draft_token_ids_in_output validates them against the grammar), so forced tokens would
    only cut its drafts to their count. Its drafts stand; none are proposed."""
    return config.speculative_config is not None and bool(getattr(config.scheduler_config, "async_scheduling", False))


def _limit(request: Any, drafts: int, max_model_len: int, spec_tokens: int) -> int:
    """Drafts worth proposing: none past max_tokens or the model's length (the bonus token of the
    pass takes one more), at most the runner's draft slots under a user's drafter."""
    params = request.sampling_params
    left = min(params.max_tokens - request.num_output_tokens if params.max_tokens is not None else drafts,
               max_model_len - request.num_tokens) - 1
    if spec_tokens:
        left = min(left, spec_tokens)
    return max(0, min(drafts, left))


def propose(manager: Any, request: Any, drafts: int, encode: Any) -> list[int]:
    """The forced tokens `request` proposes for its next step (written to its spec_token_ids by
    the caller), counted as proposed for its backend; [] when it proposes none."""
    request.__dict__.pop(MARK, None)
    request.__dict__.pop(BONUS_FREE, None)
    structured = request.structured_output_request
    if structured is None or request.is_finished() or why_not_drafted(request.sampling_params):
        return []
    if drafter_writes_drafts(manager.vllm_config):
        return []
    if TALLY not in request.__dict__:
        _start(manager, request)
    if not accepts_enough(request):
        return []
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return []  # vLLM bans stop tokens until then, outside the grammar's mask
    if manager.reasoner_cls is not None and not structured.reasoning_ended:
        return []
    grammar = structured.grammar
    backend = backend_of(grammar)
    if backend is None:
        return []
    config = manager.vllm_config
    if config.speculative_config is None and fill.fixed_blocks():
        _log_once("blocks", "logitgate forced drafts: off in this engine (this vLLM gives each request a fixed "
                  "block of num_speculative_tokens + 1 bitmask rows, one without a speculative config: no room "
                  "for draft rows); they run under a --speculative-config")
        return []
    limit = _limit(request, drafts, config.model_config.max_model_len, config.num_speculative_tokens)
    if limit <= 0:
        return []
    rule = last_token_rule(manager, request)
    tokens = forced_for(backend, grammar, encode, limit, rule)
    if tokens:
        setattr(request, MARK, (backend, len(tokens)))
        # Drafts that end the forced string (fewer than the limit: the grammar is free after them)
        # leave a free bonus row, which sample_first may defer past them.
        setattr(request, BONUS_FREE, rule == "keep" and len(tokens) < limit)
        metrics.add(f"forced_proposed_{backend}", len(tokens))
    return tokens


def count_verified(request: Any, num_drafts: int, num_accepted: int, manager: Any = None) -> None:
    """The outcome of `request`'s forced drafts in the step that verified them: accepted drafts are
    decode passes saved; counted for the request and, given its engine's structured-output
    `manager`, for its schema (SchemaTallies)."""
    mark = request.__dict__.pop(MARK, None) if request is not None else None
    if mark is None or num_drafts <= 0:
        return
    tally = request.__dict__.setdefault(TALLY, [0, 0])
    was_drafting = accepts_enough(request)
    tally[0] += num_drafts
    tally[1] += num_accepted
    if was_drafting and not accepts_enough(request):
        metrics.add("forced_requests_stopped")
    key = _schema_key(request) if manager is not None else None
    if key is not None:
        schema_tallies(manager).add(key, num_drafts, num_accepted)
    backend = mark[0]
    metrics.add(f"forced_accepted_{backend}", num_accepted)
    metrics.add(f"forced_passes_saved_{backend}", num_accepted)
