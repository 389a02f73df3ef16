"""Prompts of random tokens, made as vLLM's benchmark client makes them for `--dataset-name random`
(vllm/benchmarks/datasets: RandomDataset.sample with no prefix and range ratio 0, vLLM 0.32-0.33).

vLLM draws, from one seeded numpy generator, every request's input and output length and an
offset, then per request takes `input_len` consecutive ids from the offset among the tokenizer's
non-special tokens, decodes them and re-encodes the text (padding with random ids or truncating,
up to MAX_RETRIES times) until the length matches, because the server receives text.
`input_len` excludes the special tokens the tokenizer adds (none for logitgate's Llama-3
tokenizer). The same draws in the same order give the same prompts as `vllm bench serve
--dataset-name random --seed S` (tests/vllm_engine/test_json_writer_engine.py compares them).
"""
from __future__ import annotations

from typing import Any

import numpy as np

MAX_RETRIES = 10  # vLLM's gen_prompt_decode_to_target_len default


def allowed_token_ids(tokenizer: Any) -> np.ndarray:
    """The ids vLLM draws prompt tokens from: the tokenizer's vocabulary less its special ids."""
    return np.setdiff1d(np.arange(tokenizer.vocab_size), np.asarray(tokenizer.all_special_ids))


def _prompt_text(tokenizer: Any, ids: list[int], length: int, rng: np.random.Generator) -> str:
    """Decode and re-encode until the text encodes to `length` ids (at most MAX_RETRIES more
    tries, padding with random ids or truncating), as vLLM does; the last text decoded."""
    for retry in range(MAX_RETRIES + 1):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length or retry == MAX_RETRIES:
            return text
        if len(ids) < length:
            ids = ids + rng.integers(0, tokenizer.vocab_size, size=length - len(ids)).tolist()
        else:
            ids = ids[:length]
    raise AssertionError("unreachable")


def random_prompt_texts(tokenizer: Any, count: int, input_len: int = 32, output_len: int = 96, seed: int = 0) -> list[str]:
    """The prompts of `vllm bench serve --dataset-name random --random-input-len input_len
    --random-output-len output_len --num-prompts count --seed seed`, as text."""
    rng = np.random.default_rng(seed)
    length = max(0, input_len - int(tokenizer.num_special_tokens_to_add()))
    rng.integers(length, length + 1, size=count)  # vLLM draws the input lengths, the output
    rng.integers(output_len, output_len + 1, size=count)  # lengths, then the offsets
    offsets = rng.integers(0, tokenizer.vocab_size, size=count)
    allowed = allowed_token_ids(tokenizer)
    return [_prompt_text(tokenizer, allowed[(int(offset) + i + np.arange(length)) % len(allowed)].tolist(), length, rng)
            for i, offset in enumerate(offsets)]


def random_prompts(tokenizer: Any, count: int, input_len: int = 32, output_len: int = 96, seed: int = 0) -> list[list[int]]:
    """The same prompts as the server tokenizes them (special tokens added where the tokenizer
    adds any)."""
    return [tokenizer.encode(text, add_special_tokens=True)
            for text in random_prompt_texts(tokenizer, count, input_len, output_len, seed)]
