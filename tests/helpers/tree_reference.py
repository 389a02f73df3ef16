"""The references, independent of vLLM, for outputs under a tree: is_complete_path (a complete path
of the tree, step by step); for greedy outputs, transformers' greedy
decoding restricted to the tree's allowed tokens (the MTP target of logitgate.models.mtp_target,
the demo target)."""
from __future__ import annotations

from pathlib import Path


def tree_greedy_reference(model_dir: str | Path, tree, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy decoding under the tree with transformers (no drafts): per prompt, the argmax of the
    target's logits over the tree's allowed tokens, step by step, until the tree's end token: the
    reference, independent of vLLM, for vLLM's greedy outputs under MTP drafts and in vLLM's parallel modes
    (any causal LM `AutoModelForCausalLM` loads: the MiMo target, the demo target)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids, state, out = list(prompt), tree.root, []
            while len(out) < max_tokens and not tree.is_finished(state):
                logits = model(torch.tensor([ids])).logits[0, -1]
                allowed = tree.allowed(state)
                token = allowed[int(logits[allowed].argmax())]
                out.append(token)
                ids.append(token)
                state = tree.step(state, token)
            outputs.append(out)
    return outputs


def is_complete_path(tree, tokens) -> bool:
    state = tree.root
    for token in tokens:
        if token not in tree.allowed(state):
            return False
        state = tree.step(state, token)
    return tree.is_finished(state)
