"""The hostile-input suite: inputs a careless or hostile caller sends (NaN rows, wrong widths,
negative states, concurrent calls, malformed files), each checked for a clear error or a defined,
backend-independent result. Shares the small xgrammar vocabulary of the structured tests."""
import os
import sys

import pytest

for _shared in ("structured", "sampling"):  # vocab_helpers, sampling_helpers
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", _shared))

from vocab_helpers import EOS, VOCAB, VOCAB_SIZE, xgr  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_info():
    return xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=VOCAB_SIZE, stop_token_ids=[EOS])
