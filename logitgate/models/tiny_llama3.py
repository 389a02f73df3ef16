"""Tiny Hugging Face Llamas with the real Llama-3 tokenizer (`real_vocab.load_tokenizer("llama3")`),
built in code: the engine tests' and benchmarks' random model (logitgate/bench/vllm_engines.py) and
the trained json_writer model start here.

With 128k tokens the embedding dominates a small model, so the output layer is tied to it; a model
folder is config.json + model.safetensors + the tokenizer files, loadable by transformers and vLLM
offline.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any


def tiny_llama3(*, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, seed: int,
                embed_std: float | None = None, max_positions: int = 1024) -> tuple[Any, Any]:
    """(LlamaForCausalLM, tokenizer): random weights from `seed`, the embedding (= output layer)
    drawn from N(0, embed_std^2) when given (transformers' own init otherwise)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from .real_vocab import load_tokenizer

    tokenizer = load_tokenizer("llama3")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    if embed_std is not None:
        with torch.no_grad():
            model.model.embed_tokens.weight.normal_(0.0, embed_std)
    return model, tokenizer


def save_model_folder(model: Any, tokenizer: Any, path: Path, extra_files: dict[str, str] | None = None) -> Path:
    """Write the model and its tokenizer (and `extra_files`: name -> text) to `path` at once: into
    a temporary folder renamed into place, so a concurrent reader never sees half a model; where
    another process finished first, its folder is kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.part{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    for name, text in (extra_files or {}).items():
        (partial / name).write_text(text, encoding="utf-8")
    try:
        partial.rename(path)
    except OSError:  # `path` exists: another process saved it first
        shutil.rmtree(partial, ignore_errors=True)
    return path
