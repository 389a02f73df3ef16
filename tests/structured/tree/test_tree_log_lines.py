"""Issue 22.11: a prefix dict's unreachable keys are quoted short in the warning (a client's tree can
carry a key of megabytes; the line used to quote it whole)."""
from __future__ import annotations

import logging

from logitgate import TreeDFA


def test_unreachable_keys_are_quoted_short(caplog):
    long_key = "_".join(["7"] + ["5"] * 20_000)  # 40k characters, never reached ("7_5" is missing)
    config = {"start_token_id": 7, "end_token_id": 1, "prefix_dict": {"7": [3], long_key: [4]}}
    with caplog.at_level(logging.WARNING, logger="logitgate.structured.tree"):
        TreeDFA.from_prefix_dict(config, cache=False)
    (record,) = [r for r in caplog.records if "can never be reached" in r.getMessage()]
    assert "1 of 2 keys" in record.getMessage() and len(record.getMessage()) < 400
