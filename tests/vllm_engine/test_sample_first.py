"""The `sample_first` operation (the sample_first/ package) against vLLM's real classes, without an
engine: the worker's side through a stand-in runner around the three replacements (accepted rows
keep their draws, rejected ones are settled under their grammar, batches the worker cannot vouch
for are masked before sampling, every row's outcome reported), and the scheduler's side with real
xgrammar and llguidance grammars over the real Llama-3 tokenizer: which rows a step leaves unfilled,
the bitmask width of each backend, and the protocol across processes (the worker mirrors a request
in the scheduler's backend once asked, says when it is ready, and only then gets its rows; a mirror
that fails or falls out of step costs that request its deferral, never the engine). The real
engines run it in test_engine_kernels.py, test_hostile_server.py and test_sample_first_served.py."""
from __future__ import annotations

import gc
import math
import pickle
import time
from concurrent.futures import Future, wait
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.helpers.vllm_runtime import needs_vllm_cpu

pytestmark = needs_vllm_cpu

V = 128256  # the Llama-3 tokenizer's


class AllowedSet:
    """A grammar of vLLM's interface that allows a fixed set of tokens at every step (its
    validate_tokens is its mask, as xgrammar's)."""

    validates_as_mask = True

    def __init__(self, allowed):
        self.allowed = set(allowed)
        self.fills = self.checks = 0

    def validate_tokens(self, tokens):
        self.checks += 1
        out = []
        for token in tokens:
            if token not in self.allowed:
                break
            out.append(token)
        return out

    def fill_bitmask(self, bitmask, index):
        self.fills += 1
        words = [0] * bitmask.shape[1]
        for token in self.allowed:
            words[token // 32] |= 1 << (token % 32)
        bitmask[index] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)

    def is_terminated(self):
        return False


def masked(logits, allowed):
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
    keep[list(allowed)] = True
    return logits.masked_fill(~keep, float("-inf"))


# ---- a stand-in model runner around the three replacements ----


def runner_class():
    """GPUModelRunner's two methods and vLLM's Sampler.sample, reduced to what they do here:
    sample_tokens -> _sample -> sampler forward -> Sampler.sample (greedy argmax, or a draw from
    softmax(logits / T), in place on the logits as vLLM's temperature is)."""
    from logitgate.integrations.vllm.sample_first import worker as sf

    def original_sample(self, logits, metadata):
        greedy = logits.argmax(dim=1)
        if metadata.all_greedy:
            return greedy
        temperature = torch.where(metadata.temperature < 1e-5, 1.0, metadata.temperature)
        probs = logits.div_(temperature.unsqueeze(1)).softmax(dim=1)  # in place, as vLLM's
        drawn = torch.multinomial(probs, 1)[:, 0]
        return torch.where(metadata.temperature < 1e-5, greedy, drawn)

    sampler_cls = type("StandInSampler", (), {"sample": sf.sampler_sample_replacement(original_sample, "sample")})

    def original__sample(self, logits, spec_decode_metadata):
        self.seen_logits = logits.clone()
        tokens = self.sampler.sample(logits, self.input_batch.sampling_metadata)
        return SimpleNamespace(sampled_token_ids=tokens.to(torch.int32).unsqueeze(1), req_ids=list(self.input_batch.req_id_to_index))

    def original_sample_tokens(self, grammar_output):
        logits = self.logits.clone()
        if grammar_output is not None:  # vLLM's apply_grammar_bitmask: the rows the scheduler filled
            from vllm.v1.structured_output import utils

            index = self.input_batch.req_id_to_index
            rows = [index[req_id] for req_id in grammar_output.structured_output_request_ids]
            packed = torch.full((logits.shape[0], np.asarray(grammar_output.grammar_bitmask).shape[1]), -1, dtype=torch.int32)
            packed[rows] = torch.from_numpy(np.asarray(grammar_output.grammar_bitmask))
            utils.xgr.apply_token_bitmask_inplace(logits, packed, indices=rows)
        return self._sample(logits, self.spec)

    return type("StandInRunner", (), {
        "sample_tokens": sf.sample_tokens_replacement(original_sample_tokens, "sample_tokens"),
        "_sample": sf.sample_replacement(original__sample, "_sample"),
    }), sampler_cls


def make_runner(logits, temperatures, spec=None):
    runner_cls, sampler_cls = runner_class()
    runner = runner_cls()
    runner.sampler = sampler_cls()
    runner.logits, runner.spec = logits, spec
    runner.input_batch = SimpleNamespace(
        req_id_to_index={f"r{i}": i for i in range(logits.shape[0])},
        logitsprocs=None,
        sampling_metadata=SimpleNamespace(temperature=torch.tensor(temperatures, dtype=torch.float32), generators={},
                                          all_greedy=max(temperatures) < 1e-5),
    )
    return runner


def deferred_output(entries, width, mirror=None):
    from logitgate.integrations.vllm.sample_first import DeferredRows

    return grammar_output(list(entries), DeferredRows.wrap(np.full((len(entries), width), -1, np.int32), entries, mirror))


def grammar_output(ids, bitmask):
    from vllm.v1.core.sched.output import GrammarOutput

    return GrammarOutput(structured_output_request_ids=ids, grammar_bitmask=bitmask)


def sample(runner, grammars, temperatures):
    width = math.ceil(runner.logits.shape[1] / 32)
    entries = {f"r{i}": (g, t, 0, ()) for i, (g, t) in enumerate(zip(grammars, temperatures)) if g is not None}
    return runner.sample_tokens(deferred_output(entries, width)).sampled_token_ids[:, 0].tolist()


def report_of(output):
    from logitgate.integrations.vllm.sample_first.protocol import REPORT

    return getattr(output, REPORT)


# ---- the worker: accepted rows keep their draws, rejected ones are settled, all reported ----


def test_mixed_batch_keeps_other_rows_and_reports_each_deferred_row():
    from logitgate.integrations.vllm.sample_first import redraw

    logits = torch.randn(4, 64)
    logits[2, 1] = 30.0  # row 2's first draw is token 1: allowed
    grammars = [AllowedSet({7, 9}), None, AllowedSet({1}), None]  # rows 1 and 3 are not deferred
    runner = make_runner(logits, [0.0, 0.0, 1.0, 0.0])
    width = math.ceil(64 / 32)
    entries = {"r0": (grammars[0], 0.0, 0, ()), "r2": (grammars[2], 1.0, 0, ())}
    output = runner.sample_tokens(deferred_output(entries, width))
    tokens = output.sampled_token_ids[:, 0].tolist()
    assert tokens[0] == int(masked(logits[0], {7, 9}).argmax())
    assert tokens[1] == int(logits[1].argmax()) and tokens[3] == int(logits[3].argmax())
    assert tokens[2] == 1
    outcomes = report_of(output).outcomes
    assert outcomes["r2"].how == "accepted"
    best = set(logits[0].topk(redraw.CANDIDATES + 1).indices.tolist())  # the first draw and the candidates after it
    assert outcomes["r0"].how == ("accepted" if int(logits[0].argmax()) in {7, 9} else
                                  "redrawn" if best & {7, 9} else "filled")
    assert all(o.seconds >= 0 for o in outcomes.values())


def test_a_rejected_greedy_row_is_settled_among_its_best_keys():
    logits = torch.arange(64, dtype=torch.float32).flip(0).unsqueeze(0)  # token 0 best
    grammar = AllowedSet({5})
    output = make_runner(logits, [0.0]).sample_tokens(deferred_output({"r0": (grammar, 0.0, 0, ())}, 2))
    assert output.sampled_token_ids[0, 0] == 5 and grammar.fills == 0
    assert report_of(output).outcomes["r0"].how == "redrawn"


def test_in_a_batch_with_drafts_a_row_without_drafts_samples_first():
    """Forced drafts (forced/): a request without drafts in a batch with drafts is deferred as in
    any batch; its token is its bonus token, checked and settled as a plain row's (logits with a
    row per request: the sparse verification's)."""
    logits = torch.randn(2, 64)
    grammars = [AllowedSet({4, 50}), AllowedSet({63})]
    spec = SimpleNamespace(num_draft_tokens=[0, 0], bonus_logits_indices=torch.tensor([0, 1]))
    runner = make_runner(logits, [0.0, 0.0], spec=spec)
    tokens = sample(runner, grammars, [0.0, 0.0])
    assert tokens == [int(masked(logits[0], {4, 50}).argmax()), 63]
    assert all(g.checks >= 1 for g in grammars)  # sampled first, then checked
    assert not torch.isinf(runner.seen_logits).any()  # the sampler saw the unmasked rows


class Stepping(AllowedSet):
    """A grammar of vLLM's interface whose allowed set depends on how many tokens it took
    (`states[i]` after i tokens), advanced and rolled back as vLLM's xgrammar grammar is."""

    def __init__(self, states):
        super().__init__(states[0])
        self.states, self.taken = [set(s) for s in states], 0
        self.seen_at = []  # the state each check and fill was made at

    def _at(self):
        self.allowed = self.states[min(self.taken, len(self.states) - 1)]
        self.seen_at.append(self.taken)

    def validate_tokens(self, tokens):
        out, taken = [], self.taken
        for token in tokens:
            if token not in self.states[min(taken, len(self.states) - 1)]:
                break
            out.append(token)
            taken += 1
        self.checks += 1
        self.seen_at.append(self.taken)
        return out

    def fill_bitmask(self, bitmask, index):
        self._at()
        super().fill_bitmask(bitmask, index)

    def accept_tokens(self, request_id, tokens):
        if len(self.validate_tokens(tokens)) != len(tokens):
            return False
        self.taken += len(tokens)
        return True

    def rollback(self, count):
        self.taken -= count

    def is_terminated(self):  # past its last state (its stop token taken)
        return self.taken >= len(self.states)


def drafted_runner(logits, temperatures, drafts, accepted, recovered=99):
    """A stand-in runner for a batch with drafts, as the sparse verification lays it out: `logits`
    has a row per request (its bonus row); each row's output is its `accepted[r]` first drafts, then
    the sampler's bonus token where every draft was accepted, else `recovered` (a token of the
    rejected draft's masked row), -1 after."""
    runner = make_runner(logits, temperatures)
    counts = [len(d) for d in drafts]
    runner.spec = SimpleNamespace(num_draft_tokens=counts, draft_token_ids=torch.tensor([t for d in drafts for t in d]),
                                  bonus_logits_indices=torch.arange(len(drafts)))
    runner.execute_model_state = SimpleNamespace(scheduler_output=SimpleNamespace(
        scheduled_spec_decode_tokens={f"r{r}": d for r, d in enumerate(drafts) if d}))

    def original__sample(self, logits, spec):
        self.seen_logits = logits.clone()
        bonus = self.sampler.sample(logits, self.input_batch.sampling_metadata)
        out = torch.full((len(drafts), 1 + max(counts)), -1, dtype=torch.int32)
        for r, tokens in enumerate(drafts):
            out[r, : accepted[r]] = torch.tensor(tokens[: accepted[r]], dtype=torch.int32)
            out[r, accepted[r]] = int(bonus[r]) if accepted[r] == len(tokens) else recovered
        return SimpleNamespace(sampled_token_ids=out, req_ids=list(self.input_batch.req_id_to_index))

    from logitgate.integrations.vllm.sample_first import worker as sf

    runner._sample = sf.sample_replacement(original__sample, "_sample").__get__(runner)
    return runner


def drafted_sample(runner, grammars, temperatures):
    width = math.ceil(runner.logits.shape[1] / 32)
    entries = {f"r{i}": (g, t, 0, ()) for i, (g, t) in enumerate(zip(grammars, temperatures))}
    return runner.sample_tokens(deferred_output(entries, width))


@pytest.mark.parametrize("bonus_first_choice,expected", [(40, 40), (5, 41)])
def test_a_drafted_rows_bonus_token_is_checked_past_its_drafts(bonus_first_choice, expected):
    """Forced drafts ending a forced string leave a free bonus row, which the scheduler defers: its
    draw is checked at the grammar's state past the drafts (token 5 is allowed before them, not
    after: redrawn to the masked argmax there), and the grammar is rolled back after the step."""
    logits = torch.zeros(2, 64)
    logits[0, bonus_first_choice], logits[0, 41], logits[1, 63] = 9.0, 5.0, 1.0
    grammars = [Stepping([{5}, {6}, {40, 41}]), AllowedSet({63})]
    runner = drafted_runner(logits, [0.0, 0.0], drafts=[[5, 6], []], accepted=[2, 0])
    output = drafted_sample(runner, grammars, [0.0, 0.0])
    assert output.sampled_token_ids.tolist() == [[5, 6, expected], [63, -1, -1]]
    assert grammars[0].taken == 0 and grammars[0].fills == 0 and grammars[0].seen_at[-1] == 2
    outcomes = report_of(output).outcomes
    assert outcomes["r0"].how == ("accepted" if expected == bonus_first_choice else "redrawn")
    assert outcomes["r1"].how == "accepted"
    assert not torch.isinf(runner.seen_logits).any()  # the sampler saw the unmasked rows


def test_a_drafted_row_whose_draft_was_rejected_has_nothing_to_check():
    """Where the verification rejected a draft, the row's token came from that draft's masked row
    (the recovered token): its bonus draw is not used, not checked, and no outcome is reported."""
    logits = torch.zeros(1, 64)
    logits[0, 3] = 9.0  # a bonus draw the grammar would refuse
    grammar = Stepping([{5}, {6}, {40}])
    runner = drafted_runner(logits, [0.0], drafts=[[5, 6]], accepted=[1], recovered=7)
    output = drafted_sample(runner, [grammar], [0.0])
    assert output.sampled_token_ids.tolist() == [[5, 7, -1]]
    assert "r0" not in report_of(output).outcomes and grammar.taken == 0 and grammar.fills == 0


def test_a_drafted_row_whose_drafts_end_the_request_has_nothing_to_check():
    """Drafts ending in the stop token (mask-forced after a closed object) end the request: the
    bonus draw after them is discarded by vLLM, so it is neither checked nor redrawn."""
    logits = torch.zeros(1, 64)
    logits[0, 3] = 9.0
    grammar = Stepping([{5}, {9}])  # 9: the stop token, after which the grammar is terminated
    runner = drafted_runner(logits, [0.0], drafts=[[5, 9]], accepted=[2])
    output = drafted_sample(runner, [grammar], [0.0])
    assert output.sampled_token_ids.tolist() == [[5, 9, 3]]
    assert "r0" not in report_of(output).outcomes and grammar.taken == 0 and grammar.fills == 0


def test_a_drafted_row_whose_grammar_refuses_its_drafts_is_left_unchecked():
    """A grammar that refuses the drafts its scheduler's twin filled masks for (a mirror out of
    step) cannot check the bonus row: reported unchecked, the draw kept for the scheduler's grammar."""
    logits = torch.zeros(1, 64)
    logits[0, 3] = 9.0
    grammar = Stepping([{8}, {6}, {40}])
    runner = drafted_runner(logits, [0.0], drafts=[[5, 6]], accepted=[2])
    output = drafted_sample(runner, [grammar], [0.0])
    assert output.sampled_token_ids.tolist() == [[5, 6, 3]]
    outcome = report_of(output).outcomes["r0"]
    assert outcome.how == "unchecked" and "[5, 6]" in outcome.why and grammar.taken == 0


def test_a_drafted_row_the_worker_cannot_vouch_for_is_masked_past_its_drafts():
    """Where the worker fills deferred rows before sampling (a processor that is not vLLM's), a
    drafted row's bonus row is masked with the grammar's state past its drafts."""
    logits = torch.zeros(1, 64)
    logits[0, 5] = 9.0
    grammar = Stepping([{5}, {40, 41}])
    runner = drafted_runner(logits, [0.0], drafts=[[5]], accepted=[1])
    runner.input_batch.logitsprocs = SimpleNamespace(argmax_invariant=[], non_argmax_invariant=[object()])
    output = drafted_sample(runner, [grammar], [0.0])
    assert output.sampled_token_ids.tolist() == [[5, 40]]
    assert grammar.fills == 1 and grammar.seen_at[-1] == 1 and grammar.taken == 0
    assert report_of(output).outcomes["r0"].how == "filled"


def test_an_argmax_invariant_processor_that_is_not_vllms_makes_the_worker_fill():
    logits = torch.randn(1, 64)
    runner = make_runner(logits, [1.0])
    runner.input_batch.logitsprocs = SimpleNamespace(argmax_invariant=[object()])
    grammar = AllowedSet({8})
    assert sample(runner, [grammar], [1.0]) == [8]
    assert grammar.fills == 1 and grammar.checks == 0


def test_a_sampler_that_skips_sampler_sample_costs_the_row_not_the_engine():
    """The row cannot be drawn again (no processed logits): it is reported unchecked, keeps its
    draw for the scheduler's grammar to refuse (that request alone ends with vLLM's error), and the
    runner fills deferred rows before sampling from then on."""
    logits = torch.zeros(1, 64)
    logits[0, 3] = 5.0
    runner = make_runner(logits, [0.0])
    runner.sampler.sample = lambda logits, metadata: logits.argmax(dim=1)  # bypasses the kept logits
    grammar = AllowedSet({9})
    output = runner.sample_tokens(deferred_output({"r0": (grammar, 0.0, 0, ())}, 2))
    assert output.sampled_token_ids[0, 0] == 3
    outcome = report_of(output).outcomes["r0"]
    assert outcome.how == "unchecked" and "did not pass through Sampler.sample" in outcome.why
    assert sample(runner, [grammar], [0.0]) == [9] and grammar.fills == 1  # masked first now


class NotItsMask(AllowedSet):
    """llguidance's way (vLLM's GuidanceGrammar): validate_tokens also accepts `lenient` tokens
    (non-canonical tokenizations) that its mask excludes."""

    validates_as_mask = False

    def __init__(self, allowed, lenient):
        super().__init__(allowed)
        self.lenient = set(lenient)

    def validate_tokens(self, tokens):
        self.checks += 1
        return [t for t in tokens[:1] if t in self.allowed | self.lenient]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_whose_validation_is_not_its_mask_is_checked_by_its_mask(temperature):
    """Issue 36.2: the draw `o` (3) that validate_tokens accepts and the mask excludes is refused
    and the row settled through the mask; a draw the mask allows is accepted by it."""
    logits = torch.full((1, 64), -5.0)
    logits[0, 3], logits[0, 40] = 40.0, 10.0  # 3 certainly first
    grammar = NotItsMask({40, 41}, lenient={3})
    output = make_runner(logits, [temperature]).sample_tokens(deferred_output({"r0": (grammar, temperature, 0, ())}, 2))
    assert int(output.sampled_token_ids[0, 0]) in ({40} if temperature == 0 else {40, 41})
    assert grammar.checks == 0 and grammar.fills == 1
    assert report_of(output).outcomes["r0"].how == "filled"
    logits[0, 3] = -5.0
    logits[0, 41] = 40.0
    output = make_runner(logits, [temperature]).sample_tokens(deferred_output({"r0": (grammar, temperature, 0, ())}, 2))
    assert int(output.sampled_token_ids[0, 0]) == 41 and report_of(output).outcomes["r0"].how == "accepted"
    assert grammar.checks == 0


def test_a_row_under_min_tokens_is_filled_before_sampling():
    """Issue 36.1: vLLM's min-tokens processor reads the masked row (it gives a structured row's stop
    tokens back where nothing else is left), so a row under its min_tokens is masked before the
    sampler sees it, as vLLM's; past min_tokens it samples first."""
    logits = torch.zeros(1, 64)
    logits[0, 3], logits[0, 20] = 5.0, 4.0
    runner = make_runner(logits, [0.0])
    state = SimpleNamespace(sampling_params=params(temperature=0.0, min_tokens=4), output_token_ids=[7, 8, 9])
    runner.requests = {"r0": state}
    grammar = AllowedSet({20})
    output = runner.sample_tokens(deferred_output({"r0": (grammar, 0.0, 0, ())}, 2))
    assert int(output.sampled_token_ids[0, 0]) == 20 and report_of(output).outcomes["r0"].how == "filled"
    assert grammar.fills == 1 and grammar.checks == 0
    assert torch.isinf(runner.seen_logits[0]).sum() == 63  # the sampler (and its processors) saw the masked row
    state.output_token_ids.append(10)  # min_tokens reached
    output = runner.sample_tokens(deferred_output({"r0": (grammar, 0.0, 0, ())}, 2))
    assert int(output.sampled_token_ids[0, 0]) == 20 and report_of(output).outcomes["r0"].how == "redrawn"
    assert grammar.fills == 1 and grammar.checks == 2


def test_a_logits_processor_that_is_not_vllms_makes_the_worker_fill():
    """A custom processor may read the masked row (as vLLM's min-tokens does): the worker vouches
    for no deferred row of its batch and masks them before sampling."""
    logits = torch.randn(1, 64)
    runner = make_runner(logits, [0.0])
    runner.input_batch.logitsprocs = SimpleNamespace(argmax_invariant=[], non_argmax_invariant=[object()])
    grammar = AllowedSet({8})
    assert sample(runner, [grammar], [0.0]) == [8]
    assert grammar.fills == 1 and grammar.checks == 0


def params(**kwargs):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=8, **kwargs)


@pytest.mark.parametrize("kwargs, defers", [
    ({"temperature": 0.0}, True),
    ({"temperature": 0.0, "seed": 3}, True),  # greedy draws nothing from its generator
    ({"temperature": 0.7}, True),
    ({"temperature": 0.7, "repetition_penalty": 1.3, "logit_bias": {5: 2.0}}, True),  # per-token: in the kept logits
    ({"temperature": 0.7, "seed": 3}, False),
    ({"temperature": 0.7, "top_p": 0.9}, False),
    ({"temperature": 0.7, "top_k": 5}, False),
    ({"temperature": 0.7, "min_p": 0.1}, False),
    ({"temperature": 0.0, "logprobs": 2}, False),
])
def test_which_sampling_parameters_sample_first(kwargs, defers):
    from logitgate.integrations.vllm.sample_first import row_can_sample_first

    assert row_can_sample_first(params(**kwargs)) is defers


# ---- real grammars: vLLM's manager with xgrammar or llguidance over the Llama-3 tokenizer ----

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}


def real_config(device="cpu", world_size=1, num_spec=0):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(distributed_executor_backend="mp", world_size=world_size),
        scheduler_config=SimpleNamespace(max_num_seqs=8, async_scheduling=False),
        model_config=SimpleNamespace(skip_tokenizer_init=False, get_vocab_size=lambda: V, is_diffusion=False,
                                     hf_config=SimpleNamespace(model_type="llama")),
        structured_outputs_config=SimpleNamespace(enable_in_reasoning=False, reasoning_parser="", reasoning_parser_plugin="",
                                                  disable_any_whitespace=True, disable_additional_properties=False),
        device_config=SimpleNamespace(device_type=device),
        speculative_config=None,
        num_speculative_tokens=num_spec,
    )


def real_request(req_id, backend, temperature=0.0, **structured):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=16, temperature=temperature,
                            structured_outputs=StructuredOutputsParams(**(structured or {"json": SCHEMA})))
    params.structured_outputs._backend = backend  # what vLLM's front end sets
    return Request(req_id, [1, 2, 3], params, None)


def ready(manager, req):
    manager.grammar_init(req)
    grammar = req.structured_output_request._grammar
    if isinstance(grammar, Future):
        wait([grammar])
    return req


class Scheduler:
    """The scheduler's side of one engine: vLLM's manager with both replacements."""

    def __init__(self, backend, **config):
        from vllm.v1.structured_output import StructuredOutputManager

        from logitgate.integrations.vllm.sample_first import layout
        from logitgate.integrations.vllm.sample_first.scheduler import (
            grammar_bitmask_replacement,
            update_from_output_replacement,
        )

        layout.runners.clear()  # stand-in runners of other tests would make this engine "local"
        gc.collect()
        self.manager = StructuredOutputManager(real_config(**config))
        self.backend = backend
        self.requests = {}
        self._fill = grammar_bitmask_replacement(StructuredOutputManager.grammar_bitmask, "grammar_bitmask")
        self._update = update_from_output_replacement(lambda self, so, out: None, "update_from_output")

    def add(self, req_id, temperature=0.0, prefix="", **structured):
        """A request, its grammar compiled; `prefix`: output it has already produced (and its
        grammar accepted), e.g. '{"name":"' to start inside a string, past the forced key."""
        from tests.helpers.real_tokenizers import real_tokenizer

        req = self.requests[req_id] = ready(self.manager, real_request(req_id, self.backend, temperature, **structured))
        for token in real_tokenizer("llama3").encode(prefix, add_special_tokens=False):
            assert req.structured_output_request.grammar.accept_tokens(req_id, [token])
            req.append_output_token_ids(token)
        return req

    def fill(self):
        return self._fill(self.manager, self.requests, list(self.requests), {})

    def update(self, output):
        self._update(SimpleNamespace(structured_output_manager=self.manager, requests=self.requests), None, output)

    @property
    def state(self):
        from logitgate.integrations.vllm.sample_first.scheduler import engine_state

        return engine_state(self.manager)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_step_of_only_deferred_rows_takes_its_width_from_the_grammar_backend(tokenizer, backend):
    """Issue 30.2: llguidance sizes its bitmask by the tokenizer (128257 tokens here: one word more
    than the model's 128256 logits); a bitmask sized by the model killed the engine."""
    from logitgate.integrations.vllm.sample_first import layout
    from logitgate.integrations.vllm.sample_first.redraw import fill_masks
    from logitgate.integrations.vllm.sample_first.scheduler import _width

    scheduler = Scheduler(backend)
    scheduler.add("r0", prefix='{"name":"')
    runner = make_runner(torch.zeros(1, 8), [0.0])
    runner.sample_tokens(None)  # a runner with both replacements samples in this process: "local"
    out = scheduler.fill()
    width = _width(scheduler.manager, scheduler.state)
    assert width == scheduler.manager.backend.allocate_token_bitmask(1).shape[1]
    assert width == ((len(tokenizer) + 31) // 32 if backend == "guidance" else (V + 31) // 32)
    # (llguidance's rows are filled first, never deferred: vLLM's own bitmask; its width is the worker's
    # to handle only where a deferred guidance row arrives, the safety net)
    assert set(getattr(out, "deferred", ())) == (set() if backend == "guidance" else {"r0"})
    assert out.shape[1] == width
    grammar = scheduler.requests["r0"].structured_output_request.grammar
    fill_masks([grammar], width)  # the grammar fills a row of that width without complaint
    del runner
    layout.runners.clear()


def test_rows_in_a_forced_state_and_rows_that_cannot_sample_first_are_filled(tokenizer):
    from logitgate.integrations.vllm.sample_first import layout

    scheduler = Scheduler("xgrammar")
    scheduler.add("free", prefix='{"name":"')
    scheduler.add("forced")  # at the start '{"name":"' is forced
    scheduler.add("top_p", temperature=0.7, prefix='{"name":"')
    scheduler.requests["top_p"].sampling_params.top_p = 0.5
    runner = make_runner(torch.zeros(1, 8), [0.0])
    runner.sample_tokens(None)
    out = scheduler.fill()
    assert set(out.deferred) == {"free"}
    np.testing.assert_array_equal(out[0], -1)
    assert (out[1] != -1).any() and (out[2] != -1).any()  # vLLM's fill
    del runner
    layout.runners.clear()


def test_a_free_bonus_row_after_forced_drafts_is_deferred_and_their_rows_are_vllms(tokenizer):
    """Forced drafts that end the forced string (BONUS_FREE) leave a free bonus row: it is deferred
    (all-ones), while its draft rows are exactly vLLM's fill of them; drafts ending inside the string
    keep every row vLLM's. The grammars are where they were, and the fills of drafted requests do
    not teach the policy what a free row's fill costs."""
    from vllm.v1.structured_output import StructuredOutputManager

    from logitgate.integrations.vllm.sample_first import layout
    from logitgate.integrations.vllm.sample_first.protocol import BONUS_FREE

    scheduler = Scheduler("xgrammar")
    free, inside = scheduler.add("free"), scheduler.add("inside")  # at the start '{"name":"' is forced
    drafts = tokenizer.encode('{"name":"', add_special_tokens=False)
    spec = {"free": drafts, "inside": drafts[:-1]}
    free.__dict__[BONUS_FREE], inside.__dict__[BONUS_FREE] = True, False
    runner = make_runner(torch.zeros(1, 8), [0.0])
    runner.sample_tokens(None)
    out = scheduler._fill(scheduler.manager, scheduler.requests, ["free", "inside"], spec)
    expected = StructuredOutputManager.grammar_bitmask(scheduler.manager, scheduler.requests, ["free", "inside"], spec).copy()
    k = len(drafts)
    assert set(out.deferred) == {"free"} and out.shape[0] == k + 1 + k
    np.testing.assert_array_equal(out[:k], expected[:k])  # the draft rows
    np.testing.assert_array_equal(out[k], -1)  # the bonus row, deferred
    assert (expected[k] != -1).any()  # (vLLM would have filled it)
    np.testing.assert_array_equal(out[k + 1 :], expected[k + 1 :])
    for req in (free, inside):
        assert req.structured_output_request.grammar.num_processed_tokens == 0
    # the policy's fill cost is a free row's: fills of drafted requests (forced states) are not timed
    assert scheduler.state.policy.costs.fill is None
    del runner
    layout.runners.clear()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_xgrammar_row_is_deferred_and_the_same_guidance_row_is_filled_first(tokenizer, temperature):
    """Issue 36.2's cost: only its filled mask checks a llguidance draw exactly, a fill after the
    forward pass that the scheduler would have run beside it; so the same request, in the same state,
    is deferred under xgrammar (validate_tokens is its mask) and filled first under llguidance: vLLM's
    own bitmask, bit for bit, and across processes no mirror asked."""
    from vllm.v1.structured_output import StructuredOutputManager

    from logitgate.integrations.vllm.sample_first import layout, validates_as_its_mask

    for backend, deferred in (("xgrammar", {"r0"}), ("guidance", set())):
        scheduler = Scheduler(backend)
        scheduler.add("r0", temperature=temperature, prefix='{"name":"')
        grammar = scheduler.requests["r0"].structured_output_request.grammar
        assert validates_as_its_mask(grammar) == (backend == "xgrammar")
        runner = make_runner(torch.zeros(1, 8), [temperature])
        runner.sample_tokens(None)  # local
        out = scheduler.fill()
        assert set(getattr(out, "deferred", ())) == deferred
        if not deferred:
            plain = StructuredOutputManager.grammar_bitmask(scheduler.manager, scheduler.requests, ["r0"], {})
            np.testing.assert_array_equal(out, plain)
        del runner
        layout.runners.clear()
        remote = Scheduler(backend)  # across processes: a mirror is asked for the xgrammar row alone
        remote.add("r0", temperature=temperature, prefix='{"name":"')
        worker = worker_for(remote, torch.zeros(1, V))
        step(remote, worker)
        sent, _ = step(remote, worker)
        assert (getattr(sent, "mirror", None) or {}) == ({"r0": backend} if deferred else {})


def test_a_row_under_min_tokens_is_filled_by_the_scheduler(tokenizer):
    """Issue 36.1: while vLLM's min-tokens processor acts on a row (it reads the masked row), the
    scheduler fills it; from min_tokens on it may sample first."""
    from logitgate.integrations.vllm.sample_first import layout

    scheduler = Scheduler("xgrammar")
    req = scheduler.add("r0", prefix='{"name":"')
    runner = make_runner(torch.zeros(1, 8), [0.0])
    runner.sample_tokens(None)
    req.sampling_params.min_tokens = req.num_output_tokens + 1
    assert not getattr(scheduler.fill(), "deferred", None)
    req.sampling_params.min_tokens = req.num_output_tokens
    assert set(scheduler.fill().deferred) == {"r0"}
    del runner
    layout.runners.clear()


OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_deferred_row_takes_the_token_vllms_mask_gives_it(tokenizer, backend):
    """Issue 36.2 with the real grammars: at the key of `{"ok": ...}` llguidance's mask allows the
    token `ok` alone while its validate_tokens accepts `o` too; xgrammar's mask allows both. A model
    that prefers `o` gets what vLLM's mask gives it: `ok` under llguidance, `o` under xgrammar."""
    from logitgate.integrations.vllm.sample_first import layout

    o, ok = (tokenizer.encode(text, add_special_tokens=False) for text in ("o", "ok"))
    scheduler = Scheduler(backend)
    scheduler.add("r0", prefix='{"', json=OK_SCHEMA)
    grammar = scheduler.requests["r0"].structured_output_request.grammar
    assert grammar.validate_tokens(o) == o  # both grammars accept `o` here
    logits = torch.zeros(1, V)
    logits[0, o[0]], logits[0, ok[0]] = 30.0, 20.0
    runner = make_runner(logits, [0.0])
    runner.sample_tokens(None)
    out = scheduler.fill()
    # Neither is deferred: xgrammar knows the key is forced, llguidance's rows are always filled first.
    assert not getattr(out, "deferred", None)
    output = runner.sample_tokens(grammar_output(["r0"], out))
    assert int(output.sampled_token_ids[0, 0]) == (ok if backend == "guidance" else o)[0]
    # The worker's safety net: a deferred row of a grammar whose validation is not its mask (none
    # arrives by the scheduler's choice) is checked by its filled mask and gets the same token.
    width = scheduler.manager.backend.allocate_token_bitmask(1).shape[1]
    output = runner.sample_tokens(deferred_output({"r0": (grammar, 0.0, 0, ())}, width))
    assert int(output.sampled_token_ids[0, 0]) == (ok if backend == "guidance" else o)[0]
    del runner
    layout.runners.clear()


def test_tree_rows_are_filled_first(tokenizer):
    from logitgate.integrations.vllm.tree.grammar import TreeOutputGrammar

    assert TreeOutputGrammar.samples_first is False  # the scheduler reads this (scheduler._candidate)


@pytest.mark.parametrize("change, reason", [({"device": "cuda"}, "the device is cuda, not the CPU"),
                                            ({"world_size": 2}, "world size 2"),
                                            ({"num_spec": 2}, "speculative decoding")])
def test_no_deferral_off_the_cpu_across_processes_or_with_drafts(tokenizer, change, reason, caplog):
    """Off, and the engine's log says so once, with the reason."""
    scheduler = Scheduler("xgrammar", **change)
    scheduler.add("r0")
    runner = make_runner(torch.zeros(1, 8), [0.0])
    runner.sample_tokens(None)
    with caplog.at_level("INFO", logger="vllm.logitgate.sample_first"):
        assert not getattr(scheduler.fill(), "deferred", None)
        assert not getattr(scheduler.fill(), "deferred", None)
    off = [r.getMessage() for r in caplog.records if "sample_first: off in this engine" in r.getMessage()]
    assert len(off) == 1 and reason in off[0], off
    del runner


def test_no_deferral_with_custom_logits_processors(tokenizer, caplog):
    """A custom logits processor may read the masked row (as vLLM's min-tokens does): an engine
    configured with one fills every row, and says so once."""
    from logitgate.integrations.vllm.sample_first import layout

    scheduler = Scheduler("xgrammar")
    scheduler.add("r0", prefix='{"name":"')
    runner = make_runner(torch.zeros(1, 8), [0.0])
    runner.sample_tokens(None)
    assert set(scheduler.fill().deferred) == {"r0"}
    scheduler.manager.vllm_config.model_config.logits_processors = ["my_package.MyProcessor"]
    with caplog.at_level("INFO", logger="vllm.logitgate.sample_first"):
        assert not getattr(scheduler.fill(), "deferred", None)
    assert any("custom logits processors" in r.getMessage() for r in caplog.records)
    del runner
    layout.runners.clear()


def test_deferred_rows_travel_to_the_worker_process_with_their_entries():
    from logitgate.integrations.vllm.sample_first import DeferredRows

    rows = DeferredRows.wrap(np.arange(6, dtype=np.int32).reshape(2, 3), {"a": (None, 0.7, 3, (5, 6))}, {"b": "guidance"})
    back = pickle.loads(pickle.dumps(SimpleNamespace(grammar_bitmask=rows), protocol=5)).grammar_bitmask
    assert type(back) is DeferredRows and back.deferred == {"a": (None, 0.7, 3, (5, 6))} and back.mirror == {"b": "guidance"}
    np.testing.assert_array_equal(back, rows)
    assert not rows[:1].deferred and not rows[:1].mirror  # a slice or copy is a plain bitmask
    import threading

    with pytest.raises(Exception):  # a scheduler's grammar object never crosses silently
        pickle.dumps(DeferredRows.wrap(rows.copy(), {"a": (threading.Lock(), 0.0, 0, ())}))


# ---- across processes: asked, compiled in the scheduler's backend, reported ready, then deferred ----


class WorkerRunner:
    """A stand-in model runner in a worker process of its own: it samples, but not in the
    scheduler's process (it leaves the in-process registry the scheduler reads after every call)."""

    def __init__(self, runner):
        self.runner = runner

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def sample_tokens(self, grammar_output):
        from logitgate.integrations.vllm.sample_first import layout

        try:
            return self.runner.sample_tokens(grammar_output)
        finally:
            layout.runners.discard(self.runner)


def worker_for(scheduler, logits):
    """A stand-in worker process's runner: vLLM's config of the engine, the requests it runs."""
    runner = make_runner(logits, [0.0] * logits.shape[0])
    runner.vllm_config = scheduler.manager.vllm_config
    runner.requests = {req_id: SimpleNamespace(sampling_params=req.sampling_params, output_token_ids=req.output_token_ids)
                       for req_id, req in scheduler.requests.items()}
    runner.input_batch.req_id_to_index = {req_id: i for i, req_id in enumerate(scheduler.requests)}
    return WorkerRunner(runner)


def step(scheduler, runner, advance=False):
    """One engine step across the process boundary (the bitmask and the output are pickled); with
    `advance`, the scheduler's grammars take the sampled tokens, as vLLM's update_from_output does."""
    out = pickle.loads(pickle.dumps(grammar_output(list(scheduler.requests), scheduler.fill()), protocol=5))
    output = pickle.loads(pickle.dumps(runner.sample_tokens(out), protocol=5))
    scheduler.update(output)
    if advance:
        for req_id, req in scheduler.requests.items():
            token = int(output.sampled_token_ids[runner.input_batch.req_id_to_index[req_id], 0])
            assert req.structured_output_request.grammar.accept_tokens(req_id, [token])
            req.append_output_token_ids(token)
    return out.grammar_bitmask, output


def wait_ready(scheduler, runner, req_id, steps=200):
    from logitgate.integrations.vllm.sample_first.scheduler import row_state

    for _ in range(steps):
        sent, output = step(scheduler, runner)
        if row_state(scheduler.requests[req_id]).mirror in ("ready", "failed"):
            return row_state(scheduler.requests[req_id]).mirror
        time.sleep(0.02)
    raise AssertionError("the mirror never settled")


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_mirror_is_compiled_in_the_schedulers_backend_and_gets_rows_only_once_ready(tokenizer, backend):
    """Issue 30.1 and 30.5: the worker mirrors in the scheduler's backend, whatever the request
    itself named, and the scheduler fills the row until the worker reports the mirror ready (no
    step waits for a compile)."""
    from logitgate.integrations.vllm.sample_first import DeferredRows
    from logitgate.integrations.vllm.sample_first.scheduler import row_state

    scheduler = Scheduler(backend)
    req = scheduler.add("r0")
    req.sampling_params.structured_outputs._backend = "xgrammar" if backend == "guidance" else "guidance"
    runner = worker_for(scheduler, torch.zeros(1, V))
    first = scheduler.fill()
    assert not getattr(first, "deferred", None)  # the worker has not said it mirrors: vLLM's fill
    step(scheduler, runner)  # the worker's first output says it keeps mirrors
    assert scheduler.state.worker_mirrors
    sent, _ = step(scheduler, runner)
    if backend == "guidance":  # its rows are filled first: no mirror is asked for them
        assert not getattr(sent, "deferred", None) and not getattr(sent, "mirror", None)
        # the worker still mirrors a guidance grammar it is asked for (the safety net's path)
        out = DeferredRows.wrap(np.asarray(scheduler.fill()), {}, {"r0": backend})
        scheduler.update(runner.sample_tokens(grammar_output(list(scheduler.requests), out)))
    else:
        assert sent.mirror == {"r0": backend} and not sent.deferred  # asked, filled meanwhile
    assert wait_ready(scheduler, runner, "r0") == "ready"
    mirror = runner.runner.__dict__["_logitgate_mirrors"]._mirrors["r0"][0]
    assert type(mirror).__name__ == {"xgrammar": "XgrammarGrammar", "guidance": "GuidanceGrammar"}[backend]
    assert row_state(req).mirror == "ready"


def test_a_mirror_follows_the_shipped_tokens_and_rows_end_as_the_masked_argmax(tokenizer):
    """Greedy rows checked by the mirror end as the scheduler's masked argmax, step after step,
    with the tokens the scheduler accepted shipped to the mirror."""
    scheduler = Scheduler("xgrammar")
    req = scheduler.add("r0")
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, V, generator=generator)
    runner = worker_for(scheduler, logits)
    step(scheduler, runner)
    wait_ready(scheduler, runner, "r0")
    grammar = req.structured_output_request.grammar
    deferred_steps = 0
    for _ in range(8):
        if grammar.is_terminated():
            break
        runner.runner.logits = torch.randn(1, V, generator=generator)
        bitmask = torch.full((1, scheduler.manager.backend.allocate_token_bitmask(1).shape[1]), -1, dtype=torch.int32)
        grammar.fill_bitmask(bitmask, 0)
        from logitgate.structured.bitmask import token_ids_from_bitmask

        allowed = token_ids_from_bitmask(bitmask, V)[0]
        expected = allowed[int(runner.logits[0, allowed].argmax())]
        sent, output = step(scheduler, runner, advance=True)
        deferred_steps += bool(getattr(sent, "deferred", None))
        assert int(output.sampled_token_ids[0, 0]) == expected
    assert deferred_steps > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_complete_guidance_grammar_ends_on_its_stop_token(tokenizer, temperature):
    """The served benchmark's guidance outputs ended in "!" (token 0): once its grammar is complete,
    llguidance's matcher is stopped, validates no token (the stop token included) and masks all but
    the stop token. A row whose first draw is the stop token must end on it."""
    from tests.helpers.real_tokenizers import real_tokenizer

    eos = real_tokenizer("llama3").eos_token_id
    scheduler = Scheduler("guidance")
    scheduler.add("r0", temperature=temperature, prefix="ab", regex="ab")
    logits = torch.zeros(1, V)
    logits[0, eos] = 30.0
    runner = worker_for(scheduler, logits)
    step(scheduler, runner)
    sent, output = step(scheduler, runner)
    assert not getattr(sent, "deferred", None) and not getattr(sent, "mirror", None)  # filled first
    assert int(output.sampled_token_ids[0, 0]) == eos
    # The worker's safety net, where a deferred row of it arrives: the stopped matcher is checked by its mask.
    grammar = scheduler.requests["r0"].structured_output_request.grammar
    width = scheduler.manager.backend.allocate_token_bitmask(1).shape[1]
    local = make_runner(logits, [temperature])
    assert int(local.sample_tokens(deferred_output({"r0": (grammar, temperature, 0, ())}, width)).sampled_token_ids[0, 0]) == eos


def test_a_mirror_that_cannot_compile_is_reported_and_its_rows_stay_filled(tokenizer, caplog):
    """Issue 30.1's variant: a grammar the worker cannot build (here: a backend the worker's manager
    does not know) is reported failed and the request's rows stay with the scheduler."""
    from logitgate.integrations.vllm.sample_first.scheduler import row_state

    scheduler = Scheduler("xgrammar")
    req = scheduler.add("r0")
    runner = worker_for(scheduler, torch.zeros(1, V))
    step(scheduler, runner)
    out = scheduler.fill()
    out.mirror["r0"] = "no-such-backend"  # as if the scheduler named a backend the worker cannot build
    with caplog.at_level("WARNING", logger="vllm.logitgate.sample_first"):
        scheduler.update(runner.sample_tokens(grammar_output(list(scheduler.requests), out)))
        for _ in range(200):  # built on the worker's builder thread (issue 36.4): reported by a later step
            if row_state(req).mirror == "failed":
                break
            time.sleep(0.02)
            step(scheduler, runner)
    assert row_state(req).mirror == "failed"
    assert any("could not mirror the grammar of request r0" in r.getMessage() for r in caplog.records)
    for _ in range(3):
        sent, _ = step(scheduler, runner)
        assert not getattr(sent, "deferred", None) and not getattr(sent, "mirror", None)


def test_a_mirror_out_of_step_costs_its_request_the_deferral_not_the_engine(tokenizer, caplog):
    """A shipment that does not continue what the mirror took in (or a token it refuses): the row
    keeps its unmasked draw for the scheduler's grammar to check, the error names the request, the
    mirror is dropped and the request is never deferred again."""
    from logitgate.integrations.vllm.sample_first.scheduler import row_state

    scheduler = Scheduler("xgrammar")
    req = scheduler.add("r0", prefix='{"name":"')
    runner = worker_for(scheduler, torch.zeros(1, V))
    step(scheduler, runner)
    wait_ready(scheduler, runner, "r0")
    out = scheduler.fill()
    out.deferred["r0"] = (None, 0.0, 5, ())  # the mirror has taken 0 tokens
    with caplog.at_level("ERROR", logger="vllm.logitgate.sample_first"):
        scheduler.update(runner.sample_tokens(grammar_output(list(scheduler.requests), out)))
    assert any("has taken 0 tokens, the scheduler's grammar 5" in r.getMessage() for r in caplog.records)
    assert row_state(req).mirror == "failed"
    assert "r0" not in runner.runner.__dict__["_logitgate_mirrors"]._mirrors
    assert not getattr(scheduler.fill(), "deferred", None)


def test_finished_requests_leave_the_worker_with_their_mirrors(tokenizer):
    """Issue 30.3: a mirror lives as long as its request is in the model runner."""
    scheduler = Scheduler("xgrammar")
    for i in range(3):
        scheduler.add(f"r{i}")
    runner = worker_for(scheduler, torch.zeros(3, V))
    step(scheduler, runner)
    for req_id in list(scheduler.requests):
        wait_ready(scheduler, runner, req_id)
    from logitgate.integrations.vllm import metrics

    mirrors = runner.runner.__dict__["_logitgate_mirrors"]
    assert len(mirrors) == 3
    before = metrics.snapshot()["sample_first_mirrors_dropped"]
    del runner.requests["r0"], runner.requests["r1"]  # finished: vLLM's runner dropped them
    runner.sample_tokens(None)
    assert set(mirrors._mirrors) == {"r2"}
    assert metrics.snapshot()["sample_first_mirrors_dropped"] == before + 2


def test_outcomes_teach_the_policy_and_a_rejecting_request_fills_first(tokenizer):
    """A request whose deferred draws are rejected (its model always prefers a raw newline, which
    no JSON string allows) soon stops being deferred; its rows are filled by the scheduler."""
    from logitgate.integrations.vllm import metrics

    scheduler = Scheduler("xgrammar")
    scheduler.add("r0")
    logits = torch.zeros(1, V)
    logits[0, tokenizer.encode("\n", add_special_tokens=False)[0]] = 10.0
    runner = worker_for(scheduler, logits)
    step(scheduler, runner)
    wait_ready(scheduler, runner, "r0")
    before = metrics.snapshot()
    deferred = [bool(getattr(step(scheduler, runner, advance=True)[0], "deferred", None)) for _ in range(12)]
    assert any(deferred) and sum(deferred) <= 4, deferred
    gained = {name: value - before[name] for name, value in metrics.snapshot().items()}
    assert gained["sample_first_rows_deferred"] == sum(deferred)
    assert gained["sample_first_rows_redrawn"] + gained["sample_first_rows_filled"] == sum(deferred)
    assert gained["sample_first_rows_accepted"] == 0 and gained["sample_first_settle_seconds"] > 0
