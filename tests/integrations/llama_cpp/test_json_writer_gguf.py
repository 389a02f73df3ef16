"""The json_writer model written as GGUF (tiny_gguf.hf_llama_gguf) is the same model in llama.cpp:
its logits match transformers', and skip-ahead with string-forced drafts writes its records with
fewer forward passes and the same tokens."""
import json

import numpy as np
import pytest

from logitgate.integrations.llama_cpp import constrain, generate
from tests.helpers.llama_helpers import load, logits_after

xgr = pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def json_writer():
    from logitgate.models.json_writer import json_writer_model
    from logitgate.models.json_writer_check import load as load_hf
    from logitgate.models.tiny_gguf import hf_llama_gguf

    path = json_writer_model()
    model, tok = load_hf(path)
    return model, tok, str(hf_llama_gguf(path))


def test_llama_cpp_logits_match_transformers(json_writer):
    from logitgate.models.random_prompts import random_prompts

    model, tok, gguf = json_writer
    llm = load(gguf, n_ctx=128)
    try:
        for prompt in random_prompts(tok, 2, seed=1):
            with torch.no_grad():
                expected = model(torch.tensor([prompt])).logits[0, -1].numpy()[: llm.n_vocab()]
            got = logits_after(llm, prompt)
            assert np.abs(got - expected).max() < 1e-2 and got.argmax() == expected.argmax()
    finally:
        llm.close()


def test_records_with_drafts_equal_records_without(json_writer):
    from logitgate.models.json_records import BOUNDED_SCHEMA, check_text
    from logitgate.models.random_prompts import random_prompts

    _, tok, gguf = json_writer
    llm = load(gguf, n_ctx=128, logits_all=True)
    try:
        grammar = str(xgr.Grammar.from_json_schema(json.dumps(BOUNDED_SCHEMA), any_whitespace=False, separators=(",", ":")))
        constraint = constrain(llm, grammar=grammar)
        for prompt in random_prompts(tok, 2, seed=2):
            plain = generate(llm, prompt, constraint, max_tokens=48, add_bos=False, skip_ahead=False)
            fast = generate(llm, prompt, constraint, max_tokens=48, add_bos=False)
            assert fast.tokens == plain.tokens and check_text(fast.text, BOUNDED_SCHEMA)["valid"]
            assert fast.accepted_drafts > 0 and fast.forward_passes < 0.8 * plain.forward_passes
    finally:
        llm.close()
