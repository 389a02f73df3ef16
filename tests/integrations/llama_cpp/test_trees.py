"""Trees (strings, token sequences, TokenTreePayload, prefix dicts) on the real llama-cpp-python:
greedy outputs are the masked argmax token for token, always a complete path, and the skip-ahead
loop gives the same tokens in fewer forward passes."""
import json

import numpy as np
import pytest

from logitgate.integrations.llama_cpp import constrain, generate
from tests.helpers.llama_helpers import CITIES, Trie, logits_after

PROMPT = "The capital I would like to visit next year is"


def reference_greedy(llm, prompt_ids, trie, max_tokens=40):
    """Masked argmax, one full evaluation per step (independent of logitgate)."""
    out = []
    while len(out) < max_tokens:
        logits = logits_after(llm, prompt_ids + out)
        allowed = trie.allowed(out)
        token = allowed[int(np.argmax(logits[allowed]))]
        out.append(token)
        if token == trie.eos:
            break
    return out


@pytest.fixture(scope="module")
def city_tokens(llm):
    return [llm.tokenize(c.encode(), add_bos=False, special=False) for c in CITIES]


def test_greedy_is_masked_argmax_and_a_complete_path(llm, city_tokens):
    prompt_ids = llm.tokenize(PROMPT.encode())
    trie = Trie(city_tokens, llm.token_eos())
    expected = reference_greedy(llm, prompt_ids, trie)
    constraint = constrain(llm, strings=CITIES)
    for skip_ahead in (False, True):
        result = generate(llm, prompt_ids, constraint, max_tokens=40, skip_ahead=skip_ahead)
        assert result.tokens == expected
        assert result.finish_reason == "stop"
        assert result.text in CITIES
    # create_completion with the processor gives the same text (llama.cpp's own loop)
    out = llm.create_completion(prompt_ids, max_tokens=40, temperature=0.0, logits_processor=constraint.processors())
    assert out["choices"][0]["text"] == result.text
    assert out["choices"][0]["finish_reason"] == "stop"


def test_greedy_mode_ignores_temperature(llm, city_tokens):
    prompt_ids = llm.tokenize(PROMPT.encode())
    constraint = constrain(llm, strings=CITIES)
    greedy = generate(llm, prompt_ids, constraint, max_tokens=40)
    for seed in range(3):
        hot = generate(llm, prompt_ids, constraint, max_tokens=40, temperature=5.0, seed=seed)
        assert hot.tokens == greedy.tokens
        assert hot.prompt_passes == 1  # the cached prompt is reused; its last token is evaluated again


def test_skip_ahead_saves_forward_passes(llm):
    # Long unique suffixes: after the first tokens of each item, the rest is forced.
    items = [f"item number {i} of the long catalogue of very specific products" for i in range(20)]
    constraint = constrain(llm, strings=items)
    plain = generate(llm, PROMPT, constraint, max_tokens=64, skip_ahead=False)
    fast = generate(llm, PROMPT, constraint, max_tokens=64, skip_ahead=True)
    assert fast.tokens == plain.tokens and fast.text in items
    assert plain.forward_passes == len(plain.tokens) - 1  # the EOS after the last token needs no pass
    assert fast.forward_passes < plain.forward_passes // 3
    assert fast.forced_tokens + fast.sampled_tokens == len(fast.tokens)


def test_sampled_outputs_are_complete_paths(llm):
    constraint = constrain(llm, strings=CITIES, mode="sampled")
    seen = set()
    for seed in range(12):
        result = generate(llm, PROMPT, constraint, max_tokens=40, temperature=3.0, seed=seed)
        assert result.text in CITIES and result.finish_reason == "stop"
        seen.add(result.text)
    assert len(seen) > 1  # it does sample


def test_token_trie_payload_and_model_id(llm, city_tokens):
    name = llm.metadata["general.name"]
    payload = {"modelId": name, "descriptors": [{"path": "city", "leaves": [
        {"name": c, "tokens": t} for c, t in zip(CITIES, city_tokens)]}]}
    by_strings = generate(llm, PROMPT, constrain(llm, strings=CITIES)).tokens
    assert generate(llm, PROMPT, constrain(llm, token_trie=payload)).tokens == by_strings
    assert generate(llm, PROMPT, constrain(llm, token_trie=json.dumps(payload), path="city")).tokens == by_strings
    wrong = dict(payload, modelId="some-other-model")
    with pytest.raises(ValueError, match="some-other-model"):
        constrain(llm, token_trie=wrong)
    constrain(llm, token_trie=wrong, model_id="some-other-model")  # explicitly accepted


def test_prefix_dict(llm, city_tokens):
    start, eos = llm.tokenize(b" is", add_bos=False)[-1], llm.token_eos()
    prefix_dict = {}
    for seq in city_tokens:
        path = [start]
        for token in seq:
            prefix_dict.setdefault("_".join(map(str, path)), set()).add(token)
            path.append(token)
        prefix_dict.setdefault("_".join(map(str, path)), set()).add(eos)
    config = {"start_token_id": start, "end_token_id": eos, "prefix_dict": {k: sorted(v) for k, v in prefix_dict.items()}}
    prompt_ids = llm.tokenize(PROMPT.encode())
    assert prompt_ids[-1] == start
    result = generate(llm, prompt_ids, constrain(llm, prefix_dict=config))
    assert result.tokens == generate(llm, prompt_ids, constrain(llm, strings=CITIES)).tokens


def test_out_of_vocabulary_ids_are_refused(llm):
    vocab = llm.n_vocab()
    with pytest.raises(ValueError, match=str(vocab + 5)):
        constrain(llm, sequences=[[1, 2], [3, vocab + 5]])
    payload = {"modelId": llm.metadata["general.name"], "descriptors": [{"path": "a", "leaves": [{"name": "x", "tokens": [vocab]}]}]}
    with pytest.raises(ValueError, match=str(vocab)):
        constrain(llm, token_trie=payload)


def test_bad_arguments(llm):
    with pytest.raises(ValueError, match="exactly one"):
        constrain(llm, strings=["a"], regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        constrain(llm)
    with pytest.raises(ValueError, match="mode"):
        constrain(llm, strings=["a"], mode="beam")
    with pytest.raises(ValueError, match="marker"):
        constrain(llm, strings=["a"], marker="")
    with pytest.raises(ValueError, match="vocabulary"):
        constrain(llm, strings=["a"], marker=[llm.n_vocab()])
    with pytest.raises(ValueError, match="llama_cpp.Llama"):
        constrain(object(), strings=["a"])


def test_compile_cache_reuses_trees(llm):
    first = constrain(llm, strings=CITIES).tree
    assert constrain(llm, strings=list(CITIES)).tree is first


def test_a_reused_processor_sees_a_new_prompt(llm):
    from llama_cpp import LogitsProcessorList

    constraint = constrain(llm, strings=CITIES)
    reused = LogitsProcessorList([constraint.logits_processor()])
    first = llm.create_completion(PROMPT, max_tokens=20, temperature=0.0, logits_processor=reused)["choices"][0]["text"]
    # the next prompt extends the last prompt and its output: still a new generation
    follow_up = PROMPT + first + ", and after that"
    again = llm.create_completion(follow_up, max_tokens=20, temperature=0.0, logits_processor=reused)["choices"][0]["text"]
    fresh = llm.create_completion(follow_up, max_tokens=20, temperature=0.0, logits_processor=constraint.processors())
    assert again == fresh["choices"][0]["text"] and again in CITIES
