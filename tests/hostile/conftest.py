"""The hostile-input suite: inputs a careless or hostile caller sends (NaN rows, wrong widths,
negative states, concurrent calls, malformed files), each checked for a clear error or a defined,
backend-independent result. Shares the small xgrammar vocabulary of the structured tests."""
import pytest

from tests.helpers.vocab_helpers import EOS, VOCAB, VOCAB_SIZE, xgr


@pytest.fixture(scope="session")
def tokenizer_info():
    return xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=VOCAB_SIZE, stop_token_ids=[EOS])
