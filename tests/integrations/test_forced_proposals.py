"""forced/proposals.py's choice of the last token of a forced string: proposed ("keep") where every
row is filled anyway, or where sample_first would defer the request's next row (the bonus row after
the string is then deferred past the drafts); left out ("drop") where the engine samples first but
would fill that row (the bonus row would be a free state vLLM fills)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from logitgate.integrations.vllm.forced import proposals
from logitgate.integrations.vllm.patching import mark_replacement
from logitgate.integrations.vllm.sample_first import scheduler
from logitgate.integrations.vllm.sample_first.policy import FIRST_WAIT


def _fill(self, *args):
    return None


class _PlainManager:  # vLLM's StructuredOutputManager without sample_first
    grammar_bitmask = _fill


class _SampleFirstManager:  # with sample_first's replacement installed
    grammar_bitmask = mark_replacement(lambda self, *args: None, _fill, "grammar_bitmask")


def _request(**params):
    values = {"logprobs": None, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": None, **params}
    return SimpleNamespace(sampling_params=SimpleNamespace(**values))


@pytest.mark.parametrize("where,manager,params,rule", [
    ("local", _SampleFirstManager, {}, "drop"),  # (no grammar backend yet: the row would be filled)
    (None, _SampleFirstManager, {}, "keep"),  # sample_first off in this engine (a GPU, several workers...)
    ("local", _PlainManager, {}, "keep"),  # sample_first not installed
    ("local", _SampleFirstManager, {"logprobs": 2}, "keep"),  # a row that never samples first
    ("local", _SampleFirstManager, {"temperature": 1.0, "top_p": 0.9}, "keep"),
])
def test_the_last_token_is_kept_where_every_row_is_filled(monkeypatch, where, manager, params, rule):
    monkeypatch.setattr(scheduler, "_deferral", lambda manager, state: where)
    monkeypatch.setattr(scheduler, "engine_state", lambda manager: None)
    assert proposals.last_token_rule(manager(), _request(**params)) == rule


@pytest.mark.parametrize("where,candidate,mirror,wait,rule", [
    ("local", True, "", 0, "keep"),  # the next row would be deferred: the bonus row is, past the drafts
    ("mirrored", True, "ready", 0, "keep"),
    ("mirrored", True, "asked", 0, "drop"),  # the worker's mirror not compiled yet: the row is filled
    ("local", True, "", FIRST_WAIT, "drop"),  # the policy fills this request's rows for now
    ("local", False, "", 0, "drop"),  # a grammar whose rows are filled first (llguidance's, a tree)
])
def test_the_last_token_is_kept_where_the_bonus_row_would_be_deferred(monkeypatch, where, candidate, mirror, wait,
                                                                       rule):
    state = scheduler.EngineState()
    monkeypatch.setattr(scheduler, "_deferral", lambda manager, _: where)
    monkeypatch.setattr(scheduler, "engine_state", lambda manager: state)
    monkeypatch.setattr(scheduler, "_backend_name", lambda manager, _: "xgrammar")
    monkeypatch.setattr(scheduler, "_candidate", lambda manager, request: object() if candidate else None)
    request = _request()
    row = scheduler.row_state(request)
    row.mirror, row.wait, row.acceptance = mirror, wait, 0.9
    assert proposals.last_token_rule(_SampleFirstManager(), request) == rule
    assert row.wait == wait  # a prediction: the policy's wait is counted down only when the bitmask is made


def test_the_stop_token_is_proposed_and_a_grammar_ending_at_free_states_is_filled_once(monkeypatch):
    """xgrammar: where a JSON object closes, the stop token alone is allowed and is proposed (a pass
    saved per request); a grammar that may end with many tokens allowed (`[a-z]+`) costs one mask
    fill to find that out, and is not filled again for it."""
    xgr = pytest.importorskip("xgrammar")
    from logitgate.structured import forced
    from tests.helpers.real_tokenizers import real_tokenizer

    tok = real_tokenizer("llama3")
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)))
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    asked = []
    real = forced.xgrammar_forced_tokens
    monkeypatch.setattr(forced, "xgrammar_forced_tokens",
                        lambda *args, **kwargs: asked.append(kwargs.get("vocab_size")) or real(*args, **kwargs))

    class Grammar:  # vLLM's XgrammarGrammar, as proposals reads it
        def __init__(self, regex, text):
            self.matcher, self.ctx, self.vocab_size = xgr.GrammarMatcher(compiler.compile_regex(regex)), None, len(tok)
            assert self.matcher.accept_string(text)

        def is_terminated(self):
            return self.matcher.is_terminated()

    closed = Grammar("ab", "ab")
    assert proposals.forced_for("xgrammar", closed, encode, 4) == [tok.eos_token_id]
    free = Grammar("[a-z]+", "ab")
    assert proposals.forced_for("xgrammar", free, encode, 4) == []
    assert proposals.forced_for("xgrammar", free, encode, 4) == []
    assert asked == [len(tok), len(tok), None]


@pytest.mark.parametrize("speculative,async_scheduling,proposed", [
    (None, True, True),  # no drafter: the scheduled tokens are the drafts
    ("ngram", False, True),  # a drafter the scheduler hears from (update_draft_token_ids)
    ("eagle3", True, False),  # the worker writes its drafter's tokens over the scheduled ones
])
def test_no_forced_tokens_where_the_worker_writes_the_drafters(monkeypatch, speculative, async_scheduling, proposed):
    monkeypatch.setattr(proposals, "forced_for", lambda *args, **kwargs: [7, 8])
    # vLLM 0.32's bitmask layout (a row per draft without a speculative config); under 0.33's blocks
    # there are none without one: tests/integrations/test_vllm_bitmask_blocks.py
    monkeypatch.setattr(proposals.fill, "fixed_blocks", lambda original=None: False)
    monkeypatch.setattr(proposals, "last_token_rule", lambda *args: "keep")
    config = SimpleNamespace(speculative_config=speculative and SimpleNamespace(method=speculative),
                             scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
                             model_config=SimpleNamespace(max_model_len=512), num_speculative_tokens=3)
    manager = SimpleNamespace(vllm_config=config, reasoner_cls=None)
    grammar = SimpleNamespace(matcher=None, ctx=None)  # an xgrammar grammar, as backend_of reads it
    request = SimpleNamespace(structured_output_request=SimpleNamespace(grammar=grammar), is_finished=lambda: False,
                              num_output_tokens=0, num_tokens=10, sampling_params=SimpleNamespace(
                                  min_p=0.0, logit_bias=None, allowed_token_ids=None, bad_words=None,
                                  presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logprobs=None,
                                  prompt_logprobs=None, seed=None, ignore_eos=False, min_tokens=0, max_tokens=50))
    assert proposals.drafter_writes_drafts(config) is not proposed
    assert proposals.propose(manager, request, 8, None) == ([7, 8] if proposed else [])


def test_a_request_whose_forced_drafts_are_mostly_rejected_stops_proposing(monkeypatch):
    """After PROBATION forced drafts verified, a request proposes more only while it accepted at
    least MIN_ACCEPTANCE of them; the stop is counted once."""
    from logitgate.integrations.vllm import metrics

    stopped = []
    monkeypatch.setattr(metrics, "add", lambda name, value=1: stopped.append(name) if name.endswith("stopped") else None)
    diffuse, trained = SimpleNamespace(), SimpleNamespace()
    for request, accepted in ((diffuse, 1), (trained, 3)):
        for _ in range(2):  # 4 drafts a step: PROBATION verified after two
            assert proposals.accepts_enough(request)
            request.__dict__[proposals.MARK] = ("xgrammar", 4)
            proposals.count_verified(request, 4, accepted)
    assert proposals.PROBATION == 8
    assert not proposals.accepts_enough(diffuse)  # 2 of 8 accepted
    assert proposals.accepts_enough(trained)  # 6 of 8
    assert stopped == ["forced_requests_stopped"]
    proposals.count_verified(diffuse, 4, 4)  # no drafts proposed (no MARK): nothing counted
    assert diffuse.__dict__[proposals.TALLY] == [8, 2]


def test_under_a_drafter_its_checked_drafts_stand_unless_the_grammar_fixes_more_tokens():
    from logitgate.integrations.vllm.forced.scheduler import update_draft_token_ids_replacement

    drafter = {"a": [5, 6, 7], "b": [5], "c": [5, 6]}  # as vLLM leaves them, checked against the grammars

    def original(self, draft_token_ids):
        for req_id in draft_token_ids.req_ids:
            self.requests[req_id].spec_token_ids = list(drafter[req_id])

    requests = {}
    for req_id in drafter:
        requests[req_id] = SimpleNamespace(spec_token_ids=[1, 2], **{proposals.MARK: ("xgrammar", 2)})
    update = update_draft_token_ids_replacement(original, "update_draft_token_ids")
    update(SimpleNamespace(requests=requests), SimpleNamespace(req_ids=list(drafter)))
    assert requests["a"].spec_token_ids == [5, 6, 7] and proposals.MARK not in vars(requests["a"])  # longer: the drafter's
    assert requests["b"].spec_token_ids == [1, 2] and proposals.MARK in vars(requests["b"])  # fewer: forced
    assert requests["c"].spec_token_ids == [5, 6]  # as long: the drafter's


def test_under_a_drafter_the_batch_names_the_requests_whose_drafts_are_forced():
    from logitgate.integrations.vllm.forced.scheduler import update_after_schedule_replacement

    requests = {"a": SimpleNamespace(**{proposals.MARK: ("xgrammar", 2)}), "b": SimpleNamespace(), "c": SimpleNamespace()}
    scheduler = SimpleNamespace(requests=requests, structured_output_manager=None,
                                vllm_config=SimpleNamespace(speculative_config=SimpleNamespace(method="ngram")))
    output = SimpleNamespace(scheduled_spec_decode_tokens={"a": [1, 2], "b": [3]})  # c: no drafts this step
    update_after_schedule_replacement(lambda self, out: None, "_update_after_schedule")(scheduler, output)
    assert getattr(output, proposals.FORCED_IDS) == frozenset({"a"})


def _schema_request(key):
    return SimpleNamespace(structured_output_request=SimpleNamespace(structured_output_key=key))


def _serve(manager, key, accepted_per_step, steps=2):
    """One request of `key`: started (as propose starts it), then `steps` steps of 4 forced drafts,
    `accepted_per_step` of each accepted, while it still proposes. Whether it started proposing."""
    request = _schema_request(key)
    proposals._start(manager, request)
    started = proposals.accepts_enough(request)
    for _ in range(steps):
        if not proposals.accepts_enough(request):
            break
        request.__dict__[proposals.MARK] = ("xgrammar", 4)
        proposals.count_verified(request, 4, accepted_per_step, manager)
    return started


def test_a_schema_whose_drafts_are_mostly_rejected_starts_its_next_requests_stopped(monkeypatch):
    """Every request used to serve its own probation: after SCHEMA_PROBATION drafts of a schema
    verified below MIN_ACCEPTANCE, its new requests start stopped, all but one in PROBE_EVERY; a
    schema the model follows, and another schema, are not affected; the stops are counted."""
    from logitgate.integrations.vllm import metrics

    counted = []
    monkeypatch.setattr(metrics, "add", lambda name, value=1: counted.append(name) if name.endswith("stopped") else None)
    manager = SimpleNamespace()
    diffuse, trained = ("json", '{"type": "object"}'), ("regex", "[a-z]+")
    probation_requests = proposals.SCHEMA_PROBATION // 8  # each verifies 8 drafts (2 steps of 4)
    assert all(_serve(manager, diffuse, 1) for _ in range(probation_requests))  # 25% accepted
    assert all(_serve(manager, trained, 4) for _ in range(probation_requests))
    counted.clear()
    started = [_serve(manager, diffuse, 1) for _ in range(2 * proposals.PROBE_EVERY)]
    assert started.count(True) == 2  # the probes
    assert len(counted) == 2 * proposals.PROBE_EVERY  # 30 started stopped, the 2 probes stopped on their own
    assert all(_serve(manager, trained, 4) for _ in range(2 * proposals.PROBE_EVERY))
    assert _serve(manager, ("json", "{}"), 0)  # an unseen schema serves its own probation
    assert _serve(SimpleNamespace(), diffuse, 1)  # another engine counts its own


def test_a_schema_resumes_when_its_probes_are_accepted():
    """The count halves past SCHEMA_WINDOW drafts, so probes the model now accepts bring the schema
    back above MIN_ACCEPTANCE."""
    manager = SimpleNamespace()
    key = ("json", "{}")
    for _ in range(proposals.SCHEMA_WINDOW // 8):
        _serve(manager, key, 0)
    tallies = proposals.schema_tallies(manager)
    assert tallies._tallies[key][0] <= proposals.SCHEMA_WINDOW
    assert [_serve(manager, key, 0) for _ in range(proposals.PROBE_EVERY)].count(True) == 1  # one probe
    for _ in range(100 * proposals.PROBE_EVERY):
        _serve(manager, key, 4, steps=16)  # the probes: 64 drafts each, all accepted
        verified, accepted, _ = tallies._tallies[key]
        if accepted >= proposals.MIN_ACCEPTANCE * verified:
            break
    else:
        raise AssertionError("the schema never resumed")
    assert all(_serve(manager, key, 4) for _ in range(proposals.PROBE_EVERY))


def test_the_engine_remembers_at_most_max_schemas(monkeypatch):
    monkeypatch.setattr(proposals, "MAX_SCHEMAS", 3)
    tallies = proposals.SchemaTallies()
    for i in range(10):
        tallies.add(("json", str(i)), 4, 0)
    assert len(tallies) == 3 and not tallies.start_request(("json", "0"))
