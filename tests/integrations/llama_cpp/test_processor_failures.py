"""Whatever fails inside the processor, no token the constraint refuses is emitted: llama-cpp-python
calls it from a C callback that swallows exceptions and would pass the logits on unmasked, so a
failure ends the generation (stop tokens only) and a processor handed to another model refuses
every token from its first call."""
import logging

import numpy as np
import pytest
from llama_cpp import LogitsProcessorList

from logitgate.integrations.llama_cpp import constrain, generate, processor
from tests.helpers.llama_helpers import CITIES, Trie

PROMPT = "The capital I would like to visit next year is"
MAX_TOKENS = 12


class Fail:
    """Wraps `fn`: its `at`-th call raises `error` (the calls before and after it go through)."""

    def __init__(self, fn, at, error):
        self.fn, self.at, self.error, self.calls = fn, at, error, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return self.fn(*args, **kwargs)


# Where a failure is injected: the processor's own steps, its tree tracker, the drafts registry.
POINTS = ["_generated", "_sync", "_constrained", "tracker.mask", "tracker.sync", "tracker.is_finished", "register"]
ERRORS = [ValueError("injected"), IndexError("injected"), MemoryError("injected"), KeyboardInterrupt()]


def _inject(p, point, at, error, monkeypatch):
    if point == "register":
        wrapper = Fail(processor.register, at, error)
        monkeypatch.setattr(processor, "register", wrapper)
        return wrapper
    owner = p._tracker if point.startswith("tracker.") else p
    name = point.removeprefix("tracker.")
    wrapper = Fail(getattr(owner, name), at, error)
    monkeypatch.setattr(owner, name, wrapper)
    return wrapper


def _run(llm, p, temperature):
    """llama-cpp-python's own generation loop (what create_completion runs), up to a stop token."""
    prompt = llm.tokenize(PROMPT.encode())
    stops = set(p.info.stop_token_ids)
    out = []
    for token in llm.generate(prompt, temp=temperature, logits_processor=LogitsProcessorList([p])):
        out.append(int(token))
        if token in stops or len(out) == MAX_TOKENS:
            break
    return out


@pytest.fixture(scope="module")
def trie(llm):
    return Trie([llm.tokenize(c.encode(), add_bos=False, special=False) for c in CITIES], llm.token_eos())


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("mode, temperature", [("greedy", 0.0), ("sampled", 1.5)])
def test_no_injected_failure_lets_a_refused_token_through(llm, trie, monkeypatch, point, mode, temperature):
    constraint = constrain(llm, strings=CITIES, mode=mode)
    stops = set(constraint.info.stop_token_ids)
    for at in (1, 2, 4):
        for error in ERRORS:
            p = constraint.logits_processor()
            with monkeypatch.context() as patch:
                wrapper = _inject(p, point, at, error, patch)
                tokens = _run(llm, p, temperature)
            fired = wrapper.calls >= at
            where = f"{point} call {at} raising {error!r}: {tokens}"
            assert (p.error is error) == fired, where
            for i, token in enumerate(tokens):
                if token not in trie.allowed(tokens[:i]):  # only a stop token that ends a failed generation
                    assert fired and token in stops and i == len(tokens) - 1, where
            assert tokens[-1] in stops, where  # the generation ended: a complete path, or cut short by the failure


@pytest.mark.parametrize("point", ["_generated", "tracker.mask", "tracker.sync"])
def test_with_drafts_too(model_path, trie, monkeypatch, point):
    """Prompt-lookup drafts (TreeDrafts) under a failing processor: drafts stop after the failure and
    no refused token is emitted."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from logitgate.integrations.llama_cpp import TreeDrafts
    from tests.helpers.llama_helpers import load

    drafted = load(model_path, draft_model=TreeDrafts(LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=6)))
    try:
        constraint = constrain(drafted, strings=CITIES)
        stops = set(constraint.info.stop_token_ids)
        for at in (1, 2, 3):
            p = constraint.logits_processor()
            with monkeypatch.context() as patch:
                wrapper = _inject(p, point, at, ValueError("injected"), patch)
                tokens = _run(drafted, p, 0.0)
            for i, token in enumerate(tokens):
                if token not in trie.allowed(tokens[:i]):
                    assert wrapper.calls >= at and token in stops and i == len(tokens) - 1, (point, at, tokens)
            assert tokens[-1] in stops
            if p.error is not None:
                assert p.valid_drafts(np.array([1, 2, 3], np.intc), tokens) == 0
    finally:
        drafted.close()


def test_a_failure_is_logged_once_and_later_calls_keep_refusing(llm, caplog):
    p = constrain(llm, strings=CITIES).logits_processor()
    vocab = llm.n_vocab()
    for _ in range(3):
        out = p(np.array([1, 2, 3], np.intc), np.zeros(vocab - 1, np.float32))  # wrong width: fails
        assert not np.isfinite(out).any()  # another model's scores: no token kept
    assert isinstance(p.error, ValueError) and str(vocab) in str(p.error) and str(vocab - 1) in str(p.error)
    assert caplog.text.count("constraint failed") == 1
    # the right width from now on: only the stop tokens keep their (own) logits
    scores = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)
    out = p(np.array([1, 2, 3], np.intc), scores)
    kept = np.flatnonzero(np.isfinite(out))
    assert set(kept.tolist()) == set(p.info.stop_token_ids) and np.array_equal(out[kept], scores[kept])


def test_the_fallback_cannot_fail():
    stops = np.array([2, 7, 128001], np.intp)  # one out of this vocabulary's range
    scores = np.arange(10, dtype=np.float32)
    out = processor.refuse(scores, stops, 10)
    assert np.flatnonzero(np.isfinite(out)).tolist() == [2, 7] and out[7] == 7.0
    assert not np.isfinite(processor.refuse(scores, stops, 11)).any()  # another width: nothing kept

    class Hostile(np.ndarray):  # an "array" whose length cannot be read
        def __len__(self):
            raise RuntimeError("no length")

    hostile = np.zeros(4, np.float32).view(Hostile)
    assert not np.isfinite(np.asarray(processor.refuse(hostile, stops, 4))).any()  # narrowed in place


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_processor_of_another_model_refuses_from_the_first_call(llm, llm2, caplog, temperature):
    """The issue's case: a processor compiled for a Llama-3 model (V = 128256) passed to a Llama-2
    model (V = 32000). It cannot end that model's generation (it does not know its stop tokens), but
    from the first call no token keeps a finite logit and the error names both vocabularies."""
    p = constrain(llm, strings=["Paris"]).processors()
    finite = []

    def after(input_ids, scores):  # what llama.cpp's samplers get after logitgate's processor
        finite.append(int(np.isfinite(scores).sum()))
        return scores

    llm2.create_completion("Hi", max_tokens=4, temperature=temperature, logits_processor=LogitsProcessorList([p[0], after]))
    assert finite == [0] * len(finite) and len(finite) == 4
    assert isinstance(p[0].error, ValueError) and "32000" in str(p[0].error) and "128256" in str(p[0].error)
    assert caplog.text.count("constraint failed") == 1
    # and the other way round: a Llama-2 processor on the Llama-3 model
    back = constrain(llm2, strings=["Paris"]).processors()
    llm.create_completion("Hi", max_tokens=2, temperature=0.0, logits_processor=back)
    assert isinstance(back[0].error, ValueError) and "128256" in str(back[0].error)


def test_input_ids_outside_the_vocabulary_are_another_models(llm):
    p = constrain(llm, strings=CITIES).logits_processor()
    out = p(np.array([1, llm.n_vocab() + 3], np.intc), np.zeros(llm.n_vocab(), np.float32))
    assert isinstance(p.error, ValueError) and str(llm.n_vocab() + 3) in str(p.error)
    assert set(np.flatnonzero(np.isfinite(out)).tolist()) == set(p.info.stop_token_ids)


def test_skip_ahead_raises_where_the_processor_failed(llm, monkeypatch):
    constraint = constrain(llm, strings=CITIES)
    real = constraint.logits_processor

    def failing():
        p = real()
        monkeypatch.setattr(p._tracker, "mask", Fail(p._tracker.mask, 1, ValueError("injected")))
        return p

    monkeypatch.setattr(constraint, "logits_processor", failing)
    with pytest.raises(RuntimeError, match="injected"):
        generate(llm, PROMPT, constraint, max_tokens=MAX_TOKENS)


def test_processor_errors_are_logged_at_error_level(llm, caplog):
    caplog.set_level(logging.ERROR, logger="logitgate.integrations.llama_cpp.processor")
    p = constrain(llm, strings=CITIES).logits_processor()
    p(np.array([1], np.intc), np.zeros(3, np.float32))
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
