"""Real Hugging Face tokenizers for tests, loaded once per process (offline, from llama.cpp's GGUF
vocabularies: logitgate.models.real_vocab). Tests that use them skip where the vocabularies cannot
be had (no gguf package and nothing cached)."""
import functools

import pytest


@functools.lru_cache(maxsize=None)
def _load(name: str):
    from logitgate.models.real_vocab import load_tokenizer

    return load_tokenizer(name)


def real_tokenizer(name: str):
    """The tokenizer `name` ("llama3", "qwen2", "llama2", ...); shared: do not modify it."""
    try:
        return _load(name)
    except (ImportError, RuntimeError) as exc:  # gguf missing, or the registry unreachable
        pytest.skip(f"real vocabulary {name!r} unavailable here: {exc}")
