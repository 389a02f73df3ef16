"""The tiny GGUF model carries the real tokenizer; model identity; skip-ahead argument errors (the
processor's failure handling: test_processor_failures.py)."""
import pytest

from logitgate.integrations.llama_cpp import constrain, generate
from tests.helpers.llama_helpers import CITIES

TEXTS = ["Hello, world!", "  New York City\n", "naïve café ünïcödé — 東京", "def f(x): return x**2", "12345 67890"]


def test_tiny_model_tokenizes_like_the_real_llama3_tokenizer(llm):
    from tests.helpers.real_tokenizers import real_tokenizer

    hf = real_tokenizer("llama3")
    assert llm.n_vocab() == 128256 and llm.token_eos() == hf.convert_tokens_to_ids("<|end_of_text|>")
    for text in TEXTS:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == hf.encode(text, add_special_tokens=False)
        ids = llm.tokenize(text.encode(), add_bos=False)
        assert llm.detokenize(ids).decode() == text


def test_model_ids(llm):
    constraint = constrain(llm, strings=CITIES)
    ids = constraint.info.model_ids
    assert llm.metadata["general.name"] in ids and any(i.endswith(".gguf") for i in ids)
    assert set(constraint.info.stop_token_ids) >= {llm.token_eos()}


def test_skip_ahead_argument_errors(llm, model_path):
    from tests.helpers.llama_helpers import load

    constraint = constrain(llm, strings=CITIES)
    with pytest.raises(ValueError, match="max_tokens"):
        generate(llm, "x", constraint, max_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        generate(llm, [], constraint)
    with pytest.raises(ValueError, match="context"):
        generate(llm, "x", constraint, max_tokens=10_000)
    other = load(model_path)
    try:
        with pytest.raises(ValueError, match="another Llama"):
            generate(other, "x", constraint)
    finally:
        other.close()
