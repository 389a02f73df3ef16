"""Fixtures of the tests that build vLLM's classes without an engine."""
from __future__ import annotations

import pytest


@pytest.fixture()
def tokenizer(monkeypatch):
    """vLLM's structured-output managers (a scheduler's, a worker's mirrors) load the real Llama-3
    tokenizer, from logitgate's offline vocabularies."""
    import vllm.v1.structured_output as structured_output

    from tests.helpers.real_tokenizers import real_tokenizer

    tok = real_tokenizer("llama3")
    monkeypatch.setattr(structured_output, "cached_tokenizer_from_config", lambda model_config: tok)
    return tok
