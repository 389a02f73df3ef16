"""A tiny Llama with the real Llama-3 tokenizer that writes the served benchmark's JSON records: a
model whose next-token distribution follows the format most of the time and leaves it sometimes,
as real models do (the random model of logitgate/bench/vllm_engines.py never follows it).

Trained in code, seeded, in about a minute of CPU time on one thread (docs/demo.md has the
measured build times), then cached as a Hugging Face model folder
(config.json, model.safetensors, the tokenizer files, recipe.json) that transformers and vLLM load:
`json_writer_model()` returns its path. A training sequence is a prompt (vLLM's random-dataset
prompt, `random_prompts`, or uniform random ids), then a record for one of the two schemas
(`json_records`) in compact JSON, then `<|end_of_text|>`; the loss covers the record and the end.
A few records are written wrong (`json_records.noisy_text`), some break the bounded schema's bounds,
and training is short, so the model leaves the format now and then (docs/demo.md has the rates).

Training cost: with 128k tokens, a full softmax per position would dominate. The records use a
few hundred tokens, so the tied embedding's rows of those tokens are trained and every other row
stays as initialised (small random vectors, also the prompt tokens' input embeddings); the
softmax's sum over the untrained rows is estimated each step from a uniform sample of them
(sampled softmax, with the log of the sampling ratio added to their logits). The saved model is an
ordinary Llama whose distribution over all 128k tokens is what the measurements use.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .json_records import CITIES, FIRST_NAMES, compact, noisy_text, random_record
from .real_vocab import cache_dir

logger = logging.getLogger(__name__)

CACHE_SUBDIR = "json_writer"


@dataclass(frozen=True)
class Recipe:
    """Everything the weights depend on, with the code `key` hashes."""
    seed: int = 0
    hidden: int = 128  # the random benchmark model's shape, so both cost the same forward pass
    intermediate: int = 256
    layers: int = 2
    heads: int = 2
    kv_heads: int = 1
    steps: int = 300
    batch: int = 32
    lr: float = 5e-3
    negatives: int = 2048  # untrained rows sampled per step for the softmax's sum
    bounded_share: float = 0.75  # records for BOUNDED_SCHEMA; the rest for UNBOUNDED_SCHEMA
    noise_share: float = 0.05  # records written wrong (json_records.noisy_text)
    vllm_prompt_share: float = 0.5  # prompts made like vLLM's random dataset; the rest uniform ids
    prompt_pool: int = 512  # distinct vLLM-style prompts, cut to each sequence's prompt length
    tilt: float = 2.0  # how strongly the prompt skews a record's first name and city (_tilts)
    prompt_len: tuple[int, int] = (8, 40)  # inclusive range of prompt lengths (the benchmark's: 32)
    # torch threads while training: fixed, so the weights do not depend on the host; one, because on a
    # shared host a parallel region waits for a descheduled thread (backends/cpu/threads.py: 3x slower here)
    threads: int = 1

    def key(self) -> str:
        """The cache folder's name: the recipe and the code that trains it, hashed."""
        digest = hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode())
        for module in TRAINING_CODE:
            digest.update(code_shape((Path(__file__).parent / module).read_text(encoding="utf-8")).encode())
        return f"llama3-h{self.hidden}-l{self.layers}-{digest.hexdigest()[:12]}"


# The modules whose code the weights depend on: a change to one trains a new model.
TRAINING_CODE = ("json_writer.py", "json_records.py", "random_prompts.py", "tiny_llama3.py")


def code_shape(source: str) -> str:
    """The source's syntax tree without docstrings (comments and layout are not in it): what the
    cache key hashes, so that editing the prose does not retrain."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def json_writer_model(recipe: Recipe | None = None) -> Path:
    """The model folder for `recipe` (default: Recipe()), trained on first use and cached under
    `$LOGITGATE_CACHE/json_writer/<key>`; a change of recipe or training code trains a new one."""
    recipe = recipe or Recipe()
    path = cache_dir() / CACHE_SUBDIR / recipe.key()
    if not (path / "recipe.json").exists():
        from .tiny_llama3 import save_model_folder

        model, tokenizer, report = train(recipe)
        save_model_folder(model, tokenizer, path, {"recipe.json": json.dumps(report, indent=1)})
    return path


def _prompts(recipe: Recipe, tokenizer: Any, rng: random.Random) -> list[list[int]]:
    """One prompt per training sequence: a prefix of one of `prompt_pool` vLLM-style prompts (the
    decode / re-encode round trip costs milliseconds each) or uniform random non-special ids."""
    from .random_prompts import allowed_token_ids, random_prompts

    allowed = allowed_token_ids(tokenizer)
    pool = random_prompts(tokenizer, recipe.prompt_pool, recipe.prompt_len[1], seed=recipe.seed)
    out = []
    for _ in range(recipe.steps * recipe.batch):
        length = rng.randint(*recipe.prompt_len)
        if rng.random() < recipe.vllm_prompt_share:
            out.append(rng.choice(pool)[:length])
        else:
            out.append([int(allowed[rng.randrange(len(allowed))]) for _ in range(length)])
    return out


def _tilts(recipe: Recipe, prompts: list[list[int]], embedding: Any) -> list[dict[str, list[float]]]:
    """Per prompt, logits that skew the record's first name and city (`random_record`'s tilt): a
    fixed random linear function of the prompt's mean direction in the initial embedding, which
    the model can learn (an attention head's average over the prompt), so that its greedy records
    differ from prompt to prompt as a real model's do."""
    import torch

    gen = torch.Generator().manual_seed(recipe.seed)
    directions = {field: torch.randn(count, embedding.shape[1], generator=gen)
                  for field, count in (("name", len(FIRST_NAMES)), ("city", len(CITIES)))}
    with torch.no_grad():
        lengths = torch.tensor([len(p) for p in prompts])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        ids = torch.tensor([t for p in prompts for t in p])
        means = torch.nn.functional.embedding_bag(ids, torch.nn.functional.normalize(embedding, dim=1), offsets, mode="mean")
        means = torch.nn.functional.normalize(means, dim=1)
        logits = {field: (recipe.tilt * means @ d.T).tolist() for field, d in directions.items()}
    return [{field: rows[i] for field, rows in logits.items()} for i in range(len(prompts))]


def _record_text(rng: random.Random, recipe: Recipe, tilt: dict[str, list[float]]) -> str:
    record = random_record(rng, bounded=rng.random() < recipe.bounded_share, tilt=tilt)
    return noisy_text(rng, record) if rng.random() < recipe.noise_share else compact(record)


def training_sequences(recipe: Recipe, tokenizer: Any, embedding: Any) -> list[tuple[list[int], int]]:
    """(prompt + record + end ids, prompt length) for every step's batch, in order; `embedding`:
    the untrained model's token embedding (the records' tilt reads it)."""
    rng = random.Random(recipe.seed)
    prompts = _prompts(recipe, tokenizer, rng)
    texts = [_record_text(rng, recipe, tilt) for tilt in _tilts(recipe, prompts, embedding)]
    records = tokenizer(texts, add_special_tokens=False)["input_ids"]
    end = tokenizer.eos_token_id
    return [(prompt + record + [end], len(prompt)) for prompt, record in zip(prompts, records)]


def train(recipe: Recipe) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, report): the trained LlamaForCausalLM, its tokenizer, and the recipe with
    the training's losses and time."""
    import torch

    from .tiny_llama3 import tiny_llama3

    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        model, tokenizer = tiny_llama3(hidden=recipe.hidden, intermediate=recipe.intermediate, layers=recipe.layers,
                                       heads=recipe.heads, kv_heads=recipe.kv_heads, seed=recipe.seed)
        sequences = training_sequences(recipe, tokenizer, model.model.embed_tokens.weight)
        data_s = time.perf_counter() - started
        with torch.enable_grad():  # a caller inside no_grad / set_grad_enabled(False) still trains
            losses = _fit(model, sequences, recipe)
        exact = _exact_loss(model, sequences[-recipe.batch :])
    finally:
        torch.set_num_threads(threads)
    report = {"recipe": dataclasses.asdict(recipe), "data_seconds": round(data_s, 1),
              "seconds": round(time.perf_counter() - started, 1), "loss_first": losses[0], "loss_last": losses[-1],
              "loss_last_batch_full_softmax": exact, "losses_every_50": losses[::50]}
    logger.info("json_writer trained in %.0f s (loss %.3f -> %.3f)", report["seconds"], losses[0], losses[-1])
    return model, tokenizer, report


def _exact_loss(model: Any, sequences: list[tuple[list[int], int]], chunk: int = 128) -> float:
    """The saved model's cross-entropy over the whole vocabulary on `sequences` (the last batch):
    what the sampled softmax estimated."""
    import torch

    ids, targets = _batch(sequences, pad=model.config.eos_token_id)
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[targets >= 0]
        wanted = targets[targets >= 0]
        total = sum(torch.nn.functional.cross_entropy(model.lm_head(hidden[i : i + chunk]), wanted[i : i + chunk],
                                                      reduction="sum").item() for i in range(0, len(wanted), chunk))
    return round(total / len(wanted), 4)


def _batch(sequences: list[tuple[list[int], int]], pad: int) -> tuple[Any, Any]:
    """Right-padded ids (B, T) and the target of each position (-1 where no loss): causal attention
    never looks right, so right padding needs no attention mask."""
    import torch

    width = max(len(ids) for ids, _ in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    targets = torch.full((len(sequences), width), -1, dtype=torch.long)
    for row, (seq, prompt_len) in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
        targets[row, prompt_len - 1 : len(seq) - 1] = torch.tensor(seq[prompt_len:])
    return ids, targets


def _fit(model: Any, sequences: list[tuple[list[int], int]], recipe: Recipe) -> list[float]:
    """AdamW with warm-up and cosine decay over the backbone and the record tokens' embedding rows."""
    import torch

    embedding = model.model.embed_tokens.weight
    vocab = embedding.shape[0]
    trained = torch.tensor(sorted({t for seq, n in sequences for t in seq[n:]}))
    index = torch.full((vocab,), -1, dtype=torch.long)
    index[trained] = torch.arange(len(trained))
    untrained = torch.nonzero(index < 0).squeeze(1)
    embedding.requires_grad_(False)
    rows = torch.nn.Parameter(embedding[trained].clone())
    params = [p for p in model.model.parameters() if p.requires_grad] + [rows]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, recipe.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * (
        0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * max(0, s - warmup) / max(1, recipe.steps - warmup)))))
    negatives_gen = torch.Generator().manual_seed(recipe.seed)
    log_ratio = math.log(len(untrained) / recipe.negatives)
    model.train()
    losses = []
    for step in range(recipe.steps):
        ids, targets = _batch(sequences[step * recipe.batch : (step + 1) * recipe.batch], pad=int(trained[0]))
        local = index[ids]
        inputs = torch.where((local >= 0).unsqueeze(-1), rows[local.clamp(min=0)], embedding[ids])
        hidden = model.model(inputs_embeds=inputs).last_hidden_state
        keep = targets >= 0
        h = hidden[keep]
        negatives = untrained[torch.randint(len(untrained), (recipe.negatives,), generator=negatives_gen)]
        logits = torch.cat([h @ rows.T, h @ embedding[negatives].T + log_ratio], dim=1)
        loss = torch.nn.functional.cross_entropy(logits, index[targets[keep]])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(round(loss.item(), 4))
    model.eval()
    with torch.no_grad():
        embedding[trained] = rows
    embedding.requires_grad_(True)
    return losses
