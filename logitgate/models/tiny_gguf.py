"""Tiny random Llama models as GGUF files, offline, with a real tokenizer (for llama.cpp tests and
benchmarks).

The tokenizer (vocabulary, merges, token types, BOS/EOS) is copied from llama.cpp's GGUF vocabulary
file (`real_vocab.gguf_vocab_file`), so llama.cpp tokenizes exactly as for the real model family;
the weights are random (seeded), so outputs mean nothing but are deterministic. The output layer
is tied to the token embedding (llama.cpp's fallback when `output.weight` is absent), which keeps
a 128k-token model small. Files are written once into `$LOGITGATE_CACHE/gguf-models/` (needs the
`gguf` package) and reused.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .real_vocab import cache_dir, gguf_vocab_file


@dataclass(frozen=True)
class TinyLlamaConfig:
    vocab: str = "llama3"  # a real_vocab.VOCABS name
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    context_length: int = 2048
    seed: int = 0

    def file_name(self) -> str:
        c = self
        return (
            f"tiny-{c.vocab}-L{c.n_layer}-E{c.n_embd}-H{c.n_head}-K{c.n_head_kv}-F{c.n_ff}"
            f"-C{c.context_length}-s{c.seed}.gguf"
        )


def tiny_llama_gguf(config: TinyLlamaConfig | None = None, **fields: object) -> Path:
    """The path of a tiny random Llama GGUF model (written on first use). Give a config or its
    fields as keywords (vocab=, n_layer=, n_embd=, ...)."""
    if config is None:
        config = TinyLlamaConfig(**fields)  # type: ignore[arg-type]
    elif fields:
        raise ValueError("give a TinyLlamaConfig or keyword fields, not both")
    if config.n_embd % config.n_head or config.n_head % config.n_head_kv:
        raise ValueError(f"n_embd must divide by n_head and n_head by n_head_kv, got {config}")
    target = cache_dir() / "gguf-models" / config.file_name()
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.part{os.getpid()}")
        _write(config, partial)
        partial.replace(target)  # atomic: a concurrent reader never sees half a file
    return target


def _tokenizer_fields(vocab: str):
    """(key, value, type, sub type) of every tokenizer.* field of the vocabulary file."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_vocab_file(vocab)))
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            out.append((key, field.contents(), field.types[0], sub))
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return out, n_vocab


def _write(config: TinyLlamaConfig, path: Path) -> None:
    import gguf

    fields, n_vocab = _tokenizer_fields(config.vocab)
    rng = np.random.default_rng(config.seed)
    e, f, head_dim = config.n_embd, config.n_ff, config.n_embd // config.n_head
    kv = head_dim * config.n_head_kv

    def weight(rows: int, cols: int, dtype=np.float32) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(dtype)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"logitgate tiny {config.vocab}")
    writer.add_block_count(config.n_layer)
    writer.add_context_length(config.context_length)
    writer.add_embedding_length(e)
    writer.add_feed_forward_length(f)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value, vtype, sub in fields:
        writer.add_key_value(key, value, vtype, sub_type=sub)
    # The embedding is scaled up so that the tied output layer gives logits of a useful spread.
    writer.add_tensor("token_embd.weight", (weight(n_vocab, e) * np.sqrt(e)).astype(np.float16))
    writer.add_tensor("output_norm.weight", np.ones(e, np.float32))
    for i in range(config.n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(e, np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(e, e, np.float16))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(kv, e, np.float16))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(kv, e, np.float16))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(e, e, np.float16))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(e, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(f, e, np.float16))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(f, e, np.float16))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(e, f, np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_llama_gguf(model_dir: str | Path, vocab: str = "llama3") -> Path:
    """A Hugging Face Llama folder of a tiny model trained here (the json_writer model,
    logitgate/models/json_writer.py) written as a GGUF file with `vocab`'s tokenizer, on first use,
    next to the folder. Embedding rows past the vocabulary file's tokens (a pad token Hugging
    Face's conversion appended) are left out: llama.cpp needs one row per token."""
    model_dir = Path(model_dir)
    target = model_dir / f"model-{vocab}.gguf"
    if not target.exists():
        partial = target.with_name(f"{target.name}.part{os.getpid()}")
        _write_hf_llama(model_dir, vocab, partial)
        partial.replace(target)
    return target


def _permute_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's rotary layout (halves) to llama.cpp's (interleaved pairs), per head."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _write_hf_llama(model_dir: Path, vocab: str, path: Path) -> None:
    import json

    import gguf
    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    fields, n_vocab = _tokenizer_fields(vocab)
    n_head, n_head_kv, e = config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or e // n_head
    rope = config.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"logitgate {model_dir.name}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(e)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, value, vtype, sub in fields:
        writer.add_key_value(key, value, vtype, sub_type=sub)

    def w(name: str) -> np.ndarray:
        return np.ascontiguousarray(weights[name].astype(np.float32))

    writer.add_tensor("token_embd.weight", np.ascontiguousarray(w("model.embed_tokens.weight")[:n_vocab]))
    if "lm_head.weight" in weights and not config.get("tie_word_embeddings", False):
        writer.add_tensor("output.weight", np.ascontiguousarray(w("lm_head.weight")[:n_vocab]))
    writer.add_tensor("output_norm.weight", w("model.norm.weight"))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", w(p + "input_layernorm.weight"))
        writer.add_tensor(f"blk.{i}.attn_q.weight", _permute_rope(w(p + "self_attn.q_proj.weight"), n_head))
        writer.add_tensor(f"blk.{i}.attn_k.weight", _permute_rope(w(p + "self_attn.k_proj.weight"), n_head_kv))
        writer.add_tensor(f"blk.{i}.attn_v.weight", w(p + "self_attn.v_proj.weight"))
        writer.add_tensor(f"blk.{i}.attn_output.weight", w(p + "self_attn.o_proj.weight"))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", w(p + "post_attention_layernorm.weight"))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(p + "mlp.gate_proj.weight"))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(p + "mlp.up_proj.weight"))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(p + "mlp.down_proj.weight"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
