"""`strings=` are the exact text of the completion on every vocabulary: Llama-3 BPE and Llama-2
SentencePiece (which writes a space before any text it tokenizes). A string that starts with a space
completes with that space."""
import pytest

from logitgate.integrations.llama_cpp import constrain, generate
from tests.helpers.llama_helpers import CITIES

PROMPTS = ["Next trip:", "The capital I would like to visit next year is", "Q: where to?\nA:"]
ITEMS = CITIES[:20] + ["AXON-5502-WHT", "naïve café", "東京"]


@pytest.fixture(params=["llm", "llm2"], ids=["llama3-bpe", "llama2-sentencepiece"])
def model(request):
    return request.getfixturevalue(request.param)


def test_sentencepiece_adds_a_space_that_strings_do_not_get(llm2):
    """The premise: Llama-2's tokenizer writes "Paris" as " Paris"; constrain() does not."""
    assert llm2.detokenize(llm2.tokenize(b"Paris", add_bos=False)) == b" Paris"
    sequence = constrain(llm2, strings=["Paris"]).info.tokenize("Paris")
    assert llm2.detokenize(sequence) == b"Paris"


@pytest.mark.parametrize("space", ["", " "])
def test_completions_are_exactly_the_strings(model, space):
    items = [space + item for item in ITEMS]
    constraint = constrain(model, strings=items)
    for item in items:  # every path of the tree spells exactly its string
        assert constraint.info.text_of(constraint.info.tokenize(item)) == item.encode()
    for prompt in PROMPTS:
        out = model.create_completion(prompt, max_tokens=24, temperature=0.0, logits_processor=constraint.processors())
        text = out["choices"][0]["text"]
        assert text in items and out["choices"][0]["finish_reason"] == "stop", (prompt, text)
        assert generate(model, prompt, constraint, max_tokens=24).text == text


def test_sampled_completions_too(llm2):
    constraint = constrain(llm2, strings=ITEMS, mode="sampled")
    for seed in range(4):
        result = generate(llm2, "Next trip:", constraint, max_tokens=24, temperature=1.5, seed=seed)
        assert result.text in ITEMS and result.finish_reason == "stop"
