"""xgrammar grammars (JSON schema, regex, EBNF, choice) over the model's own vocabulary, on the real
llama-cpp-python: outputs are valid, greedy equals the masked argmax, skip-ahead changes nothing
but the number of forward passes."""
import json
import re

import numpy as np
import pytest

from logitgate.integrations.llama_cpp import constrain, generate
from tests.helpers.llama_helpers import CITIES, logits_after

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": CITIES[:12]}, "visits": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["city", "visits"],
    "additionalProperties": False,
}


def test_json_schema_greedy_is_masked_argmax(llm):
    constraint = constrain(llm, json=SCHEMA, disable_any_whitespace=True)
    prompt_ids = llm.tokenize(b"Answer in JSON:")
    result = generate(llm, prompt_ids, constraint, max_tokens=60, skip_ahead=False)
    assert result.finish_reason == "stop"
    value = json.loads(result.text)
    assert value["city"] in CITIES[:12] and 0 <= value["visits"] <= 99
    # replay: every emitted token is the argmax of the logits masked by a fresh grammar state
    backend = constraint.info.grammar_backend()
    grammar = constraint.grammar.fresh()
    bitmask = backend.allocate_token_bitmask(1)
    for i, token in enumerate(result.tokens):
        logits = logits_after(llm, prompt_ids + result.tokens[:i])
        backend.fill_bitmasks([grammar], bitmask, [0])
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[: llm.n_vocab()].astype(bool)
        assert token == int(np.argmax(np.where(bits, logits, -np.inf))), f"position {i}"
        assert grammar.accept_tokens([token])
    fast = generate(llm, prompt_ids, constraint, max_tokens=60, skip_ahead=True)
    assert fast.tokens == result.tokens and fast.forward_passes <= result.forward_passes


def test_create_completion_and_chat_completion(llm):
    constraint = constrain(llm, json=SCHEMA, disable_any_whitespace=True)  # a random model loves whitespace
    out = llm.create_completion("Answer in JSON:", max_tokens=80, temperature=0.0, logits_processor=constraint.processors())
    value = json.loads(out["choices"][0]["text"])
    assert value["city"] in CITIES[:12]
    chat = llm.create_chat_completion(
        messages=[{"role": "user", "content": "Which city? Answer in JSON."}],
        max_tokens=80, temperature=0.0, logits_processor=constraint.processors(),
    )
    assert json.loads(chat["choices"][0]["message"]["content"])["city"] in CITIES[:12]


@pytest.mark.parametrize("kind,spec,check", [
    ("regex", r"[A-Z][a-z]{2,6}-[0-9]{3}", lambda s: re.fullmatch(r"[A-Z][a-z]{2,6}-[0-9]{3}", s)),
    ("grammar", 'root ::= "yes" | "no" | "maybe " [0-9]', lambda s: s in ("yes", "no") or re.fullmatch(r"maybe [0-9]", s)),
    ("choice", ["red wine", "white wine", "water"], lambda s: s in ("red wine", "white wine", "water")),
])
def test_regex_ebnf_choice(llm, kind, spec, check):
    constraint = constrain(llm, **{kind: spec})
    for seed in range(3):
        result = generate(llm, "Say:", constraint, max_tokens=30, temperature=1.5, seed=seed)
        assert result.finish_reason == "stop" and check(result.text), result.text


def test_forced_grammar_tokens_are_batched(llm):
    # After "The answer: " the grammar allows one token sequence only (one tokenization is allowed
    # per step when the literal's next token is unique), so skip-ahead saves passes.
    constraint = constrain(llm, grammar='root ::= "The answer is " ("alpha" | "beta") " and that is final."')
    slow = generate(llm, "Q:", constraint, max_tokens=40, skip_ahead=False)
    fast = generate(llm, "Q:", constraint, max_tokens=40, skip_ahead=True)
    assert fast.tokens == slow.tokens
    assert fast.text in ("The answer is alpha and that is final.", "The answer is beta and that is final.")
    assert fast.forced_tokens > 0 or fast.forward_passes == slow.forward_passes


def test_invalid_grammar_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="invalid"):
        constrain(llm, regex="[unclosed")
    with pytest.raises(ValueError, match="invalid"):
        constrain(llm, json='{"type": "object", "properties": 5}')
