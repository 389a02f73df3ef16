"""Span activation: generation starts free, the tree applies after the marker and lets go at the
path's end; greedy-only-inside-the-span; several spans per generation."""
import numpy as np

from logitgate.integrations.llama_cpp import constrain
from tests.helpers.llama_helpers import CITIES


class Script:
    """Test helper (not logitgate): forces given tokens at given generated positions ({position:
    token}), so that a random model writes the marker; other positions are left free."""

    def __init__(self, prompt_len, tokens):
        self.prompt_len = prompt_len
        self.tokens = tokens if isinstance(tokens, dict) else dict(enumerate(tokens))

    def __call__(self, input_ids, scores):
        token = self.tokens.get(len(input_ids) - self.prompt_len)
        if token is None:
            return scores
        out = np.full_like(scores, -np.inf)
        out[token] = 0.0
        return out


def test_span_after_marker_then_free(llm):
    from llama_cpp import LogitsProcessorList

    prompt = llm.tokenize(b"Trip log.")
    lead = llm.tokenize(b" Destination:", add_bos=False)
    constraint = constrain(llm, strings=[" " + c for c in CITIES], marker="Destination:")
    processor = constraint.logits_processor()
    out = llm.create_completion(
        prompt, max_tokens=len(lead) + 12, temperature=0.0,
        logits_processor=LogitsProcessorList([Script(len(prompt), lead), processor]),
    )
    text = out["choices"][0]["text"]
    assert text.startswith(" Destination:")
    rest = text[len(" Destination:"):]
    city = next(c for c in sorted(CITIES, key=len, reverse=True) if rest.startswith(" " + c))
    # the span ended at the path's end (no EOS forced): generation went on, free
    assert len(rest) > len(city) + 1 and out["choices"][0]["finish_reason"] == "length"
    assert not processor.in_span and processor.error is None


def test_no_marker_no_constraint(llm):
    constraint = constrain(llm, strings=CITIES, marker="NEVER-WRITTEN-MARKER")
    free = llm.create_completion("Hello", max_tokens=8, temperature=0.0)["choices"][0]["text"]
    gated = llm.create_completion("Hello", max_tokens=8, temperature=0.0, logits_processor=constraint.processors())
    assert gated["choices"][0]["text"] == free


def test_two_spans_with_token_marker(llm):
    from llama_cpp import LogitsProcessorList

    prompt = llm.tokenize(b"Pairs.")
    marker = llm.tokenize(b" ->", add_bos=False)
    constraint = constrain(llm, strings=[" yes", " no"], marker=marker)
    processor = constraint.logits_processor()
    # the script writes the marker, leaves the next token to the span (one token per item, so
    # the span ends right after it), then writes the marker again
    yes_no = {llm.tokenize(b" yes", add_bos=False)[0], llm.tokenize(b" no", add_bos=False)[0]}

    m = len(marker)
    script = Script(len(prompt), {**dict(enumerate(marker)), **{m + 1 + i: t for i, t in enumerate(marker)}})
    out = llm.generate(prompt, temp=0.0, logits_processor=LogitsProcessorList([script, processor]))
    tokens = [next(out) for _ in range(2 * m + 2)]
    out.close()
    assert tokens[m] in yes_no and tokens[-1] in yes_no
    assert tokens[:m] == marker == tokens[m + 1 : 2 * m + 1]
