"""A tiny random MiMo target (a Qwen2 model with one multi-token-prediction layer) on the demo
vocabulary, saved as a checkpoint vLLM loads with `speculative_config={"method": "mtp"}`.

MTP drafts come from layers inside the target's checkpoint, so the demo target (a plain Llama) has
none; MiMo is the smallest dense architecture vLLM drafts MTP for (`mimo_mtp.MiMoMTP`, one draft
token a step). The weights are random: the MTP layer proposes garbage and the tree must hold
anyway. Weight names are those vLLM's `mimo.MiMoForCausalLM` (the target; it skips
`model.mtp_layers.*`) and `mimo_mtp.MiMoMTP` (the drafter) load. Transformers loads the same
directory as `Qwen2ForCausalLM` (the MTP weights ignored): the reference for greedy outputs.
"""
from __future__ import annotations

import json
from pathlib import Path

NUM_SPECULATIVE_TOKENS = 1  # vLLM's MiMo MTP predicts one token a step (MiMoMTP.forward asserts it)


def save_mtp_target(directory: str | Path, seed: int = 0) -> Path:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from logitgate.models.byte_tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    hidden, inter = 64, 128
    # A wider init than transformers' 0.02 keeps the random target's top logits apart, so greedy
    # choices do not hinge on float rounding between vLLM's kernels and transformers'.
    config = Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.2,
                         bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(out)
    weights = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 1)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.05

    mtp = {"token_layernorm.weight": torch.ones(hidden), "hidden_layernorm.weight": torch.ones(hidden),
           "final_layernorm.weight": torch.ones(hidden), "input_proj.weight": rand(hidden, 2 * hidden),
           "input_layernorm.weight": torch.ones(hidden), "post_attention_layernorm.weight": torch.ones(hidden),
           "self_attn.o_proj.weight": rand(hidden, hidden), "mlp.gate_proj.weight": rand(inter, hidden),
           "mlp.up_proj.weight": rand(inter, hidden), "mlp.down_proj.weight": rand(hidden, inter)}
    for proj in ("q_proj", "k_proj", "v_proj"):
        mtp[f"self_attn.{proj}.weight"], mtp[f"self_attn.{proj}.bias"] = rand(hidden, hidden), rand(hidden)
    weights.update({f"model.mtp_layers.0.{name}": tensor for name, tensor in mtp.items()})
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    saved = json.loads((out / "config.json").read_text())
    saved.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(saved, indent=1))
    return out
