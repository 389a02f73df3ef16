"""Shared by the structured tests: a small offline vocabulary for real xgrammar grammars — the 256
single bytes, a few multi-byte pieces (so tokenisations differ from bytes), a stop token and padding
up to VOCAB_SIZE — and reference rows from plain xgrammar matchers."""
from __future__ import annotations

import pytest

xgr = pytest.importorskip("xgrammar")

PIECES = [b'{"', b'"}', b'":', b'", "', b"name", b"age", b"true", b"false", b"null", b"yes", b"no", b"maybe",
          b"</", b"think", b">", b"</think>", b"ab", b"abc"]
VOCAB = [bytes([i]) for i in range(256)] + PIECES + [b"</s>"]
EOS = len(VOCAB) - 1
VOCAB_SIZE = 320  # padded past the tokenizer's vocabulary, as models do
THINK_END = [256 + PIECES.index(b"</"), 256 + PIECES.index(b"think"), 256 + PIECES.index(b">")]
THINK_END_ONE = 256 + PIECES.index(b"</think>")

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def encode(text: str | bytes) -> list[int]:
    """Greedy longest-match tokenisation over VOCAB (never produces the stop or think tokens)."""
    data = text.encode() if isinstance(text, str) else text
    usable = {p: 256 + i for i, p in enumerate(PIECES) if p not in (b"</think>",)}
    out, i = [], 0
    while i < len(data):
        for length in (4, 3, 2):
            piece = data[i : i + length]
            if len(piece) == length and piece in usable:
                out.append(usable[piece])
                i += length
                break
        else:
            out.append(data[i])
            i += 1
    return out


def plain_rows(compiled, prefixes: list[list[int]]):
    """Reference rows from a plain xgrammar matcher: the mask after each token prefix."""
    import torch

    bitmask = xgr.allocate_token_bitmask(len(prefixes), VOCAB_SIZE)
    for row, prefix in enumerate(prefixes):
        matcher = xgr.GrammarMatcher(compiled)
        for t in prefix:
            assert matcher.accept_token(t), (prefix, t)
        matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask.to(torch.int32)
