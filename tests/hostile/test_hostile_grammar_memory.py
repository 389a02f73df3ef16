"""The xgrammar compiler cache is bounded by default (a server sees unboundedly many schemas)."""
import pytest

from logitgate.structured import StructuredOutputManager, StructuredOutputsParams
from logitgate.structured.xgrammar_backend import CACHE_LIMIT_ENV, DEFAULT_CACHE_LIMIT_BYTES, XGrammarBackend
from tests.helpers.vocab_helpers import VOCAB_SIZE


def test_the_compiler_cache_is_bounded_by_default(tokenizer_info, monkeypatch):
    monkeypatch.delenv(CACHE_LIMIT_ENV, raising=False)
    assert DEFAULT_CACHE_LIMIT_BYTES == 512 * 1024 * 1024
    assert XGrammarBackend(tokenizer_info, vocab_size=VOCAB_SIZE).compiler.cache_limit_bytes == DEFAULT_CACHE_LIMIT_BYTES
    # The manager's own engines too.
    with StructuredOutputManager(tokenizer_info, vocab_size=VOCAB_SIZE) as manager:
        manager.add_request("r", StructuredOutputsParams(regex="a+"))
        manager.wait("r")
        assert manager._get_backend("xgrammar").compiler.cache_limit_bytes == DEFAULT_CACHE_LIMIT_BYTES


def test_the_limit_comes_from_the_argument_or_the_environment(tokenizer_info, monkeypatch):
    monkeypatch.setenv(CACHE_LIMIT_ENV, "64")
    assert XGrammarBackend(tokenizer_info, vocab_size=VOCAB_SIZE).compiler.cache_limit_bytes == 64 * 1024 * 1024
    assert XGrammarBackend(tokenizer_info, vocab_size=VOCAB_SIZE, cache_limit_bytes=4096).compiler.cache_limit_bytes == 4096
    monkeypatch.setenv(CACHE_LIMIT_ENV, "-1")
    assert XGrammarBackend(tokenizer_info, vocab_size=VOCAB_SIZE).compiler.cache_limit_bytes == -1
    for bad in ("lots", "0", "1.5"):
        monkeypatch.setenv(CACHE_LIMIT_ENV, bad)
        with pytest.raises(ValueError, match=CACHE_LIMIT_ENV):
            XGrammarBackend(tokenizer_info, vocab_size=VOCAB_SIZE)
    monkeypatch.delenv(CACHE_LIMIT_ENV)
    for bad in (0, -2, 1.5, True, "512"):
        with pytest.raises(ValueError, match="cache_limit_bytes"):
            XGrammarBackend(tokenizer_info, vocab_size=VOCAB_SIZE, cache_limit_bytes=bad)


def test_many_distinct_schemas_stay_within_the_limit(tokenizer_info):
    limit = 64 * 1024
    bounded = XGrammarBackend(tokenizer_info, vocab_size=VOCAB_SIZE, cache_limit_bytes=limit)
    unbounded = XGrammarBackend(tokenizer_info, vocab_size=VOCAB_SIZE, cache_limit_bytes=-1)
    sizes, largest = [], 0
    for i in range(60):
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}, "v": {"enum": [str(i), "x"]}}}
        largest = max(largest, bounded.compile("json", schema).compiled.memory_size_bytes)
        unbounded.compile("json", schema)
        sizes.append(bounded.compiler.get_cache_size_bytes())
    # xgrammar evicts after inserting, so the cache may overshoot by the grammar just added.
    assert max(sizes) <= limit + largest
    assert 0 < sizes[-1] and unbounded.compiler.get_cache_size_bytes() > 4 * limit
