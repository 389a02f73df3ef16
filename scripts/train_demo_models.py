"""Train the embedded demo models: a byte-level target / draft causal-LM pair over a catalog of names.

The catalog is the IANA time-zone names from `zoneinfo.available_timezones()` (or `--catalog FILE`,
one name a line). Each name is trained as `<bos> hint <root> name <eos>` with three hints: none, its
region ("Europe" for "Europe/Berlin") and its city ("Berlin", underscores as spaces); the loss
covers only the name and `<eos>`, the part a tree constraint governs. The target is a 4-layer,
128-wide Llama; the draft a 2-layer, 64-wide Llama trained on the same data plus distillation from
the target's next-token distribution, so that its greedy choices agree with the target's (that is
what speculative decoding accepts).

Writes (default `logitgate/data/demo/`): `target/`, `draft/` (safetensors, float16, each with the
byte tokenizer as Hugging Face tokenizer files: logitgate/models/hf_byte_tokenizer.py), `catalog.txt`,
`tree.json` (the prefix dict rooted at `<root>`), and prints a JSON report: sizes, losses, training
time, how often unconstrained output (greedy by kind of prompt, and sampled) is a catalog name,
and draft/target agreement. zoneinfo's list depends on the host's tz database; `catalog.txt` keeps
the one the shipped models were trained on (`--catalog logitgate/data/demo/catalog.txt` retrains on it).

    PYTHONPATH=$PWD python scripts/train_demo_models.py     # about 4 minutes on 2 shared CPU cores
    PYTHONPATH=$PWD python scripts/train_demo_models.py --tokenizer-only   # rewrite the tokenizer files only
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
import zoneinfo
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from logitgate.bench.harness import emit
from logitgate.models import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, catalog_prefix_dict, demo_prompt
from logitgate.models.demo import DEMO_DIR, load_catalog
from logitgate.models.hf_byte_tokenizer import write_demo_tokenizers

# zoneinfo lists this host alias of the system zone; it is not a zone name.
_NOT_ZONES = {"localtime"}
MAX_NEW_TOKENS = 40  # longest name (32 bytes) + <eos>, with room to spare


def default_catalog() -> list[str]:
    return sorted(zoneinfo.available_timezones() - _NOT_ZONES)


HINT_KINDS = ("plain", "region", "city")


def hint(name: str, kind: str) -> str | None:
    """The prompt hint of `name` of one kind: none, its region ("Europe"), its city ("New York");
    None where the name has no such part."""
    if kind == "plain":
        return ""
    if "/" not in name:
        return None
    return name.split("/", 1)[0] if kind == "region" else name.rsplit("/", 1)[1].replace("_", " ")


def make_examples(names: list[str], kinds: tuple[str, ...]) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) for every name under every hint kind it has."""
    examples = []
    for name in names:
        for kind in kinds:
            hint_text = hint(name, kind)
            if hint_text is None:
                continue
            prompt = demo_prompt(hint_text)
            examples.append((prompt + list(name.encode("utf-8")) + [EOS_ID], len(prompt)))
    return examples


def collate(batch: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and labels (-100 on the prompt and the padding)."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for row, (ids, prompt_len) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
    return input_ids, labels


def llama(hidden: int, layers: int, heads: int, intermediate: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return LlamaForCausalLM(config)


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB_SIZE), labels[:, 1:].reshape(-1), ignore_index=-100)


@torch.no_grad()
def name_logprobs(model: LlamaForCausalLM, examples: list[tuple[list[int], int]], batch_size: int = 256) -> list[torch.Tensor]:
    """Per example, the model's next-token log-probabilities at the name positions (n, V)."""
    out = []
    for i in range(0, len(examples), batch_size):
        input_ids, labels = collate(examples[i : i + batch_size])
        logp = F.log_softmax(model(input_ids=input_ids).logits[:, :-1].float(), dim=-1)
        keep = labels[:, 1:] != -100
        out.extend(logp[row][keep[row]].clone() for row in range(len(logp)))
    return out


def batches(examples: list, batch_size: int, rng: random.Random) -> list[list[int]]:
    """Example indices in batches of similar length (little padding), in random order."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i][0]), rng.random()))
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(chunks)
    return chunks


def train(
    model: LlamaForCausalLM,
    examples: list[tuple[list[int], int]],
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    teacher_logprobs: list[torch.Tensor] | None = None,
    distill_weight: float = 0.0,
) -> dict[str, Any]:
    """AdamW with warm-up and cosine decay. With teacher log-probabilities (one (n, V) tensor per
    example) the loss mixes cross-entropy with KL(teacher || model) on the name positions.
    Returns the last epoch's mean loss and the time taken."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    total = epochs * math.ceil(len(examples) / batch_size)
    warmup = max(1, min(100, total // 10))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / warmup if s < warmup else 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup))),
    )
    model.train()
    start = time.perf_counter()
    epoch_loss = float("nan")
    for epoch in range(epochs):
        losses = []
        for batch in batches(examples, batch_size, rng):
            input_ids, labels = collate([examples[i] for i in batch])
            logits = model(input_ids=input_ids).logits
            loss = next_token_loss(logits, labels)
            if teacher_logprobs is not None and distill_weight > 0:
                keep = labels[:, 1:] != -100
                teacher = torch.cat([teacher_logprobs[i] for i in batch])
                student = F.log_softmax(logits[:, :-1][keep], dim=-1)
                kl = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
                loss = (1 - distill_weight) * loss + distill_weight * kl
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
        epoch_loss = sum(losses) / len(losses)
        if epoch % 10 == 0 or epoch == epochs - 1:
            print(f"  epoch {epoch:3d} loss {epoch_loss:.4f} ({time.perf_counter() - start:.0f}s)", file=sys.stderr)
    model.eval()
    return {"final_epoch_loss": round(epoch_loss, 4), "train_seconds": round(time.perf_counter() - start, 1), "epochs": epochs}


@torch.no_grad()
def eval_loss(model: LlamaForCausalLM, examples: list[tuple[list[int], int]], batch_size: int = 256) -> float:
    """Mean next-token cross-entropy (nats) on the name positions."""
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        input_ids, labels = collate(examples[i : i + batch_size])
        n = int((labels[:, 1:] != -100).sum())
        total += float(next_token_loss(model(input_ids=input_ids).logits, labels)) * n
        count += n
    return total / count


# Well-known cities that are not zone names: prompts the catalog has no answer for, where an
# unconstrained model makes names up ("Europe/Munich") and the tree constraint cannot.
OFF_CATALOG_CITIES = (
    "Munich", "Hamburg", "Milan", "Barcelona", "Lyon", "Krakow", "Seville", "Naples", "Geneva", "Porto",
    "Seattle", "San Francisco", "Houston", "Miami", "Boston", "Atlanta", "Dallas", "Ottawa", "Calgary",
    "Osaka", "Kyoto", "Beijing", "Mumbai", "Delhi", "Bangalore", "Hanoi", "Busan", "Shenzhen",
    "Cape Town", "Alexandria", "Rio de Janeiro", "Medellin", "Wellington", "Brisbane", "Ankara",
)


@torch.no_grad()
def generate_texts(model: LlamaForCausalLM, prompts: list[list[int]], *, sample: bool = False) -> list[str | None]:
    """Unconstrained continuations (text before `<eos>`) of left-padded prompts, greedy or sampled
    at temperature 1 over the whole vocabulary; None where no `<eos>` came."""
    width = max(map(len, prompts))
    input_ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    options = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
    out = model.generate(
        input_ids=input_ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        **options,
    )[:, width:].tolist()
    return [bytes(t for t in row[: row.index(EOS_ID)] if t < 256).decode("utf-8", "replace") if EOS_ID in row else None for row in out]


def validity(model: LlamaForCausalLM, names: list[str], seed: int) -> dict[str, Any]:
    """How often unconstrained output is a catalog name, by kind of prompt."""
    catalog = set(names)

    def rate(oks: list[bool]) -> float:
        return round(sum(oks) / len(oks), 4)

    firsts = sorted({n[0] for n in names})
    by_letter = [None if out is None else c + out for c, out in zip(firsts, generate_texts(model, [demo_prompt() + [ord(c)] for c in firsts]))]
    regions = sorted({n.split("/", 1)[0] for n in names if "/" in n})
    by_region = generate_texts(model, [demo_prompt(r) for r in regions])
    cities = [(hint(n, "city"), n) for n in names if "/" in n]
    by_city = generate_texts(model, [demo_prompt(c) for c, _ in cities])
    known = {hint(n, "city") for n in names if "/" in n}
    unseen = [c for c in OFF_CATALOG_CITIES if c not in known]
    by_unseen = generate_texts(model, [demo_prompt(c) for c in unseen])
    torch.manual_seed(seed)
    sampled = generate_texts(model, [demo_prompt()] * 200 + [demo_prompt(r) for r in regions] * 10, sample=True)
    return {
        "greedy_first_letter_valid": rate([out in catalog for out in by_letter]),
        "greedy_first_letter_prompts": len(firsts),
        "greedy_region_valid": rate([out in catalog and out.startswith(r + "/") for r, out in zip(regions, by_region)]),
        "greedy_region_outputs": dict(zip(regions, by_region)),
        "greedy_city_valid": rate([out in catalog for out in by_city]),
        "greedy_city_exact": rate([out == n for out, (_, n) in zip(by_city, cities)]),
        "greedy_city_prompts": len(cities),
        "greedy_off_catalog_city_valid": rate([out in catalog for out in by_unseen]),
        "greedy_off_catalog_city_outputs": dict(zip(unseen, by_unseen)),
        "sampled_t1_valid": rate([out in catalog for out in sampled]),
        "sampled_t1_samples": len(sampled),
        "sampled_t1_invalid_examples": [out for out in sampled if out not in catalog][:8],
    }


@torch.no_grad()
def agreement(target: LlamaForCausalLM, draft: LlamaForCausalLM, examples: list[tuple[list[int], int]]) -> dict[str, float]:
    """Per name position (teacher-forced on the catalog): how often the draft's argmax equals the
    target's (the greedy acceptance rate of speculative decoding), and each model's accuracy."""
    agree = target_acc = draft_acc = count = 0
    for i in range(0, len(examples), 256):
        input_ids, labels = collate(examples[i : i + 256])
        keep = labels[:, 1:] != -100
        t = target(input_ids=input_ids).logits[:, :-1].argmax(-1)[keep]
        d = draft(input_ids=input_ids).logits[:, :-1].argmax(-1)[keep]
        y = labels[:, 1:][keep]
        agree += int((t == d).sum())
        target_acc += int((t == y).sum())
        draft_acc += int((d == y).sum())
        count += int(keep.sum())
    return {
        "draft_target_argmax_agreement": round(agree / count, 4),
        "target_next_token_accuracy": round(target_acc / count, 4),
        "draft_next_token_accuracy": round(draft_acc / count, 4),
        "positions": count,
    }


def save(model: LlamaForCausalLM, path: Path, dtype: torch.dtype) -> dict[str, Any]:
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.max_new_tokens = MAX_NEW_TOKENS
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    model.to(torch.float32)
    files = {p.name: p.stat().st_size for p in sorted(path.iterdir())}
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "bytes_on_disk": sum(files.values()),
        "files": files,
        "layers": model.config.num_hidden_layers,
        "hidden": model.config.hidden_size,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=DEMO_DIR, help="where the models, catalog and tree go")
    parser.add_argument("--catalog", type=Path, default=None, help="names file (default: zoneinfo's time zones)")
    parser.add_argument("--target-epochs", type=int, default=40)
    parser.add_argument("--draft-epochs", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hints", default="plain,region,city", help=f"prompt kinds to train, from {','.join(HINT_KINDS)}")
    parser.add_argument("--target-lr", type=float, default=4e-3)
    parser.add_argument("--draft-lr", type=float, default=5e-3)
    parser.add_argument("--distill-weight", type=float, default=0.5, help="KL-to-target share of the draft's loss")
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    parser.add_argument("--threads", type=int, default=1, help="1 is steadier than 2 on a shared machine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the JSON report here instead of stdout")
    parser.add_argument("--tokenizer-only", action="store_true",
                        help="only (re)write the Hugging Face tokenizer files next to the existing models")
    args = parser.parse_args(argv)
    if args.tokenizer_only:
        for path in write_demo_tokenizers([args.out_dir / "target", args.out_dir / "draft"]):
            print(path, file=sys.stderr)
        return 0

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    names = load_catalog(args.catalog) if args.catalog else default_catalog()
    kinds = tuple(k for k in args.hints.split(",") if k)
    if not kinds or set(kinds) - set(HINT_KINDS):
        parser.error(f"--hints takes a comma-separated subset of {','.join(HINT_KINDS)}, got {args.hints!r}")
    examples = make_examples(names, kinds)
    plain = [ex for ex in examples if ex[1] == 2]  # <bos> <root> name <eos>
    print(f"{len(names)} names, {len(examples)} training sequences", file=sys.stderr)

    target = llama(hidden=128, layers=4, heads=4, intermediate=256)
    print("training target", file=sys.stderr)
    target_train = train(target, examples, epochs=args.target_epochs, lr=args.target_lr, batch_size=args.batch_size, seed=args.seed)
    draft = llama(hidden=64, layers=2, heads=2, intermediate=128)
    print("training draft", file=sys.stderr)
    start = time.perf_counter()
    teacher = name_logprobs(target, examples) if args.distill_weight > 0 else None
    draft_train = train(
        draft, examples, epochs=args.draft_epochs, lr=args.draft_lr, batch_size=args.batch_size, seed=args.seed + 1,
        teacher_logprobs=teacher, distill_weight=args.distill_weight,
    )
    draft_train["train_seconds"] = round(time.perf_counter() - start, 1)  # includes the teacher's pass

    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    target_info = save(target, out / "target", dtype)
    draft_info = save(draft, out / "draft", dtype)
    write_demo_tokenizers([out / "target", out / "draft"])
    (out / "catalog.txt").write_text("\n".join(names) + "\n", encoding="utf-8")
    (out / "tree.json").write_text(json.dumps(catalog_prefix_dict(names), separators=(",", ":")) + "\n", encoding="utf-8")

    # Evaluate what was shipped: the stored (half-precision) weights, reloaded.
    target = LlamaForCausalLM.from_pretrained(out / "target", local_files_only=True, dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(out / "draft", local_files_only=True, dtype=torch.float32).eval()
    report = {
        "names": len(names),
        "training_sequences": len(examples),
        "threads": args.threads,
        "hints": list(kinds),
        "dtype": args.dtype,
        "target": {**target_info, **target_train, "eval_loss_nats": round(eval_loss(target, examples), 4)},
        "draft": {**draft_info, **draft_train, "eval_loss_nats": round(eval_loss(draft, examples), 4)},
        "total_bytes_on_disk": sum(p.stat().st_size for p in out.rglob("*") if p.is_file()),
        "target_unconstrained": validity(target, names, args.seed),
        "draft_unconstrained": {k: v for k, v in validity(draft, names, args.seed).items() if not k.endswith(("outputs", "examples"))},
        "agreement_plain_prompt": agreement(target, draft, plain),
        "agreement_all_prompts": agreement(target, draft, examples),
    }
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
