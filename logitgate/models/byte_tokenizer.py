"""A byte-level tokenizer in code: token i < 256 is the byte i, then four special tokens.

It needs neither Hugging Face nor a vocabulary file, so the embedded demo models work offline and
any UTF-8 text (not only the training catalog) can be encoded."""
from __future__ import annotations

import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)

NUM_BYTES = 256
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
# The token a tree-constrained prompt ends with: RTP-LLM's tree decode starts its DFA at the last
# prompt token, so the catalog's prefix dict is rooted here.
ROOT_ID = 259
VOCAB_SIZE = 260

SPECIAL_TOKENS: dict[str, int] = {"<bos>": BOS_ID, "<eos>": EOS_ID, "<pad>": PAD_ID, "<root>": ROOT_ID}
_SPECIAL_NAMES = {i: name for name, i in SPECIAL_TOKENS.items()}


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS, EOS, PAD and the tree-root token.

    Calling the tokenizer is `encode`: `tok("Europe/Berlin") -> [69, 117, ...]`."""

    vocab_size: int = VOCAB_SIZE
    bos_token_id: int = BOS_ID
    eos_token_id: int = EOS_ID
    pad_token_id: int = PAD_ID
    root_token_id: int = ROOT_ID

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """The UTF-8 bytes of `text` as token ids, optionally framed by BOS / EOS."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, BOS_ID)
        if add_eos:
            ids.append(EOS_ID)
        return ids

    __call__ = encode

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens are dropped or rendered as `<bos>`, `<eos>`, `<pad>`, `<root>`.

        Byte runs that are not valid UTF-8 (a sampled sequence cut mid-character) decode with U+FFFD."""
        pieces: list[str] = []
        run = bytearray()
        for position, token in enumerate(ids):
            token = int(token)
            if 0 <= token < NUM_BYTES:
                run.append(token)
                continue
            if token not in _SPECIAL_NAMES:
                raise ValueError(f"token id {token} at position {position} is outside the vocabulary [0, {VOCAB_SIZE})")
            if not skip_special_tokens:
                pieces.append(run.decode("utf-8", errors="replace"))
                run.clear()
                pieces.append(_SPECIAL_NAMES[token])
        pieces.append(run.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def is_special(self, token_id: int) -> bool:
        return token_id in _SPECIAL_NAMES

    def token_bytes(self) -> list[bytes]:
        """The bytes each token stands for, index = token id; special tokens are empty.

        This is xgrammar's RAW encoded vocabulary: `xgrammar.TokenizerInfo(tok.token_bytes(),
        vocab_size=tok.vocab_size, stop_token_ids=[tok.eos_token_id])` treats the empty entries as
        special tokens that no grammar can match."""
        return [bytes([i]) for i in range(NUM_BYTES)] + [b""] * (VOCAB_SIZE - NUM_BYTES)

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={VOCAB_SIZE}, bos={BOS_ID}, eos={EOS_ID}, pad={PAD_ID}, root={ROOT_ID})"
