"""Tiny random EAGLE / EAGLE-3 draft heads for the demo target, saved as checkpoints vLLM loads.

A random head proposes garbage, which is the point: tree decode must hold whatever the drafter
proposes (drafts the tree rejects never emitted, greedy outputs equal those without drafts). The
heads share the target's embedding and lm_head (vLLM's proposer reuses the target's when a
checkpoint has none), so some drafts land on the tree and reach verification; most do not. Weight names and shapes are those vLLM's
`llama_eagle.EagleLlamaForCausalLM` and `llama_eagle3.Eagle3LlamaForCausalLM` load; a missing or
misnamed weight fails vLLM's loader at start-up ("weights were not initialized from checkpoint").
"""
from __future__ import annotations

import json
from pathlib import Path

METHODS = ("eagle", "eagle3")


def _head_config(method: str, target: dict) -> dict:
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size",
            "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias", "mlp_bias")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
              "tie_word_embeddings": False, "torch_dtype": "float32", **{k: target[k] for k in keep if k in target}}
    if method == "eagle3":
        # Name three distinct target layers: vLLM's default for Llama, (2, L // 2, L - 3), repeats
        # layer 2 on the 4-layer demo target and hands the head two hidden states instead of three.
        layers = target["num_hidden_layers"]
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, layers // 2, layers - 1]}
    return config


def _weights(method: str, config: dict, seed: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    # EAGLE-3's one layer attends over [embedding, hidden state] (2 * hidden wide).
    attn_in = 2 * hidden if method == "eagle3" else hidden

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.05

    layer = {
        "self_attn.q_proj.weight": rand(heads * head_dim, attn_in),
        "self_attn.k_proj.weight": rand(kv_heads * head_dim, attn_in),
        "self_attn.v_proj.weight": rand(kv_heads * head_dim, attn_in),
        "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "mlp.gate_proj.weight": rand(inter, hidden),
        "mlp.up_proj.weight": rand(inter, hidden),
        "mlp.down_proj.weight": rand(hidden, inter),
        "post_attention_layernorm.weight": torch.ones(hidden),
    }
    if method == "eagle":  # layer 0 has no input norm; fc fuses [embedding, target hidden state]
        weights = {"fc.weight": rand(hidden, 2 * hidden)}
    else:  # fc fuses three target layers' hidden states; the head has its own norms
        layer["input_layernorm.weight"] = torch.ones(hidden)
        layer["hidden_norm.weight"] = torch.ones(hidden)
        weights = {"fc.weight": rand(hidden, 3 * hidden), "norm.weight": torch.ones(hidden)}
    weights.update({f"layers.0.{name}": tensor for name, tensor in layer.items()})
    return {name: tensor.contiguous() for name, tensor in weights.items()}


def save_eagle_head(directory: str | Path, method: str, target_dir: str | Path, seed: int = 0) -> Path:
    """Write `config.json` + `model.safetensors` of a random `method` head for the target in
    `target_dir` into `directory`; returns it. The directory name carries the method (vLLM also
    infers the method from the name)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = _head_config(method, json.loads((Path(target_dir) / "config.json").read_text()))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file(_weights(method, config, seed), str(out / "model.safetensors"))
    return out
