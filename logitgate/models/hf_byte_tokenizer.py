"""The demo's byte tokenizer as a real Hugging Face tokenizer, saved next to the demo models.

Same ids as `ByteTokenizer`: token i < 256 is the byte i, then `<bos>` 256, `<eos>` 257, `<pad>`
258, `<root>` 259. It is a `tokenizers` byte-level BPE with the 256 single bytes and no merges, so
`AutoTokenizer`, `xgrammar.TokenizerInfo.from_huggingface` and engines such as vLLM load it with the
model directory. Two behaviours are those of any Hugging Face tokenizer, not of `ByteTokenizer`:
encoding with special tokens (the default) prepends `<bos>`, and the text of a special token in the
input is that token, so the prompt text "Berlin<root>" encodes to `demo_prompt("Berlin")`.

`write_demo_tokenizers()` writes `tokenizer.json` and `tokenizer_config.json` into the demo model
directories (run by `scripts/train_demo_models.py`, or alone with `--tokenizer-only`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .byte_tokenizer import BOS_ID, EOS_ID, NUM_BYTES, PAD_ID, ROOT_ID, SPECIAL_TOKENS, VOCAB_SIZE

MAX_LENGTH = 128  # the demo models' max_position_embeddings


def build_hf_byte_tokenizer() -> Any:
    """A `transformers` fast tokenizer with exactly `ByteTokenizer`'s ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    char_of_byte = bytes_to_unicode()  # byte-level BPE writes each byte as one printable character
    backend = Tokenizer(models.BPE(vocab={char_of_byte[b]: b for b in range(NUM_BYTES)}, merges=[]))
    # No regex split and no prefix space: the text's UTF-8 bytes, one token each.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    for name, token_id in sorted(SPECIAL_TOKENS.items(), key=lambda item: item[1]):
        backend.add_special_tokens([AddedToken(name, special=True, normalized=False)])
        if backend.token_to_id(name) != token_id:  # the ids are the models' embedding rows
            raise RuntimeError(f"{name} got id {backend.token_to_id(name)}, expected {token_id}")
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS_ID)]
    )
    names = {i: name for name, i in SPECIAL_TOKENS.items()}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=names[BOS_ID],
        eos_token=names[EOS_ID],
        pad_token=names[PAD_ID],
        additional_special_tokens=[names[ROOT_ID]],
        model_max_length=MAX_LENGTH,
        padding_side="left",  # batched prompts of a decoder-only model are left-padded for generate()
    )
    if len(tokenizer) != VOCAB_SIZE:
        raise RuntimeError(f"the tokenizer has {len(tokenizer)} tokens, expected {VOCAB_SIZE}")
    return tokenizer


def write_demo_tokenizers(directories: list[Path] | None = None) -> list[Path]:
    """Save the tokenizer into each model directory (default: the demo target and draft); returns
    the files written."""
    from .demo import DRAFT_DIR, TARGET_DIR

    tokenizer = build_hf_byte_tokenizer()
    written: list[Path] = []
    for directory in directories or [TARGET_DIR, DRAFT_DIR]:
        written += [Path(p) for p in tokenizer.save_pretrained(str(directory)) if Path(p).is_file()]
    return written
