"""How often a model's unconstrained output is a valid record: the json_writer model's measure
(tests, scripts/train_json_writer.py, docs/demo.md).

Decodes in transformers from the served benchmark's prompts (`random_prompts`, 32 tokens), greedy
or sampled at a temperature over the whole vocabulary (no top-k, no top-p), until
`<|end_of_text|>` or `max_new_tokens`, and checks each text against both schemas
(`json_records.check_text`).
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .json_records import SCHEMAS, check_text

MAX_NEW_TOKENS = 96  # the served benchmark's output length


def load(path: Path) -> tuple[Any, Any]:
    """(model, tokenizer) of a model folder, offline, in float32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return model.eval(), tokenizer


def decode(model: Any, prompts: list[list[int]], temperature: float, seed: int = 0,
           max_new_tokens: int = MAX_NEW_TOKENS) -> list[tuple[list[int], list[float]]]:
    """Per prompt (all of one length), the generated ids, the end token included where reached,
    and the model's top probability at each of those steps (how peaked its distribution was)."""
    import torch

    end = model.config.eos_token_id
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(prompts), use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].float()
        done = torch.zeros(len(prompts), dtype=torch.bool)
        tokens, tops = [], []
        for _ in range(max_new_tokens):
            probs = torch.softmax(logits / (temperature or 1.0), -1)
            tops.append(probs.max(-1).values)
            if temperature == 0:
                token = logits.argmax(-1)
            else:  # the exponential race: argmax p / E with E ~ Exp(1) is a draw from p
                token = (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(-1)
            token = torch.where(done, end, token)
            tokens.append(token)
            done |= token == end
            if bool(done.all()):
                break
            out = model(input_ids=token.unsqueeze(1), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1].float()
    rows, top_rows = torch.stack(tokens, 1).tolist(), torch.stack(tops, 1).tolist()
    cut = [row.index(end) + 1 if end in row else len(row) for row in rows]
    return [(row[:n], top[:n]) for row, top, n in zip(rows, top_rows, cut)]


_PUNCTUATION = set('{}[]":,')
_KEYS = {key for schema in SCHEMAS.values() for key in schema["properties"]}


def is_structural(token_text: str) -> bool:
    """A token the schema's grammar forces, whatever the content: JSON punctuation or a key."""
    return set(token_text) <= _PUNCTUATION or token_text.strip('{}[]":,') in _KEYS


def validity(model: Any, tokenizer: Any, prompts: list[list[int]], temperature: float, seed: int = 0,
             batch: int = 64) -> dict[str, Any]:
    """Per schema, the fraction of outputs that are `valid` (parse and satisfy the schema) and
    `exact` (also the compact text the structured-outputs grammar accepts, then the end token);
    `ended` (the end token came before max_new_tokens), the mean top probability at structural
    and at content steps, the number of distinct texts and a few of them."""
    texts, ended, structural, content = [], 0, [], []
    end = model.config.eos_token_id
    for start in range(0, len(prompts), batch):
        for ids, tops in decode(model, prompts[start : start + batch], temperature, seed + start):
            finished = bool(ids) and ids[-1] == end
            ended += finished
            texts.append((tokenizer.decode(ids[:-1] if finished else ids), finished))
            for token, top in zip(ids, tops):
                (structural if token == end or is_structural(tokenizer.decode([token])) else content).append(top)
    report: dict[str, Any] = {"n": len(texts), "temperature": temperature, "ended": round(ended / len(texts), 3)}
    for name, schema in SCHEMAS.items():
        checks = [check_text(text, schema) for text, _ in texts]
        report[name] = {"valid": round(sum(c["valid"] for c in checks) / len(texts), 3),
                        "exact": round(sum(c["exact"] and done for c, (_, done) in zip(checks, texts)) / len(texts), 3)}
    # How peaked the distribution is where the next token is structural (near 1) and where it is content.
    for name, tops in (("structural", structural), ("content", content)):
        report[f"top_p_{name}"] = {"mean": round(statistics.fmean(tops), 3), "median": round(statistics.median(tops), 3)} if tops else None
    report["distinct"] = len({text for text, _ in texts})
    report["examples"] = [text for text, _ in texts[:4]]
    return report
