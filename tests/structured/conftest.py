"""Fixtures for the structured tests (the vocabulary itself is in vocab_helpers.py)."""
import pytest

from tests.helpers.vocab_helpers import EOS, VOCAB, VOCAB_SIZE, xgr


@pytest.fixture(scope="session")
def tokenizer_info():
    return xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=VOCAB_SIZE, stop_token_ids=[EOS])


@pytest.fixture(scope="session")
def compiler(tokenizer_info):
    return xgr.GrammarCompiler(tokenizer_info)

