"""logitgate in llama.cpp vs llama.cpp's own grammar sampler (GBNF, `LlamaGrammar`) on the same
constraint, with the real llama-cpp-python.

    python scripts/bench_llama_cpp.py [--quick] [--rounds N] [--items N] [--embd E] [--layers L] [--out FILE] [--plot FILE.png]

Model: a tiny random Llama with the real Llama-3 tokenizer (V = 128256), written as GGUF in code
(logitgate.models.tiny_gguf, cached). Cases, each over the same prompts, greedy:

- catalog: a completion that must be one of >= 1000 catalog items (brand, product, size).
  logitgate (skip-ahead loop: forced tokens fed in one batch), logitgate_processor (the logits
  processor in llama-cpp-python's own create_completion), gbnf_tokens (the catalog's token
  sequences as a GBNF trie of `<[id]>` terminals: exactly the same constraint, so greedy outputs
  must be identical), gbnf_text (the items as GBNF string literals: what a llama.cpp user writes;
  it also accepts other tokenizations, so outputs may differ).
- json: a JSON object with a product enum (the first 200 items) and a quantity: logitgate's
  xgrammar schema vs `LlamaGrammar.from_json_schema`.

Per method, interleaved (for each prompt every method in turn, each run after `llm.reset()`, so
every run evaluates the prompt; a warm-up round first), the median over rounds per prompt of the
wall time of one completion (prompt included), then: ms per completion (mean over prompts),
tokens/s (generated tokens / those times), forward passes (llama.cpp decode calls after the prompt, per
completion), the skip ratio ((V - valid) / V per step, mean) and token agreement with logitgate's
output (fraction of positions with the same token).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BRANDS = ["Acme", "Bosch", "Makita", "Stanley", "DeWalt", "Hitachi", "Ryobi", "Festool", "Milwaukee", "Metabo",
          "Hilti", "Einhell"]
PRODUCTS = ["claw hammer", "screwdriver set", "cordless drill", "angle grinder", "circular saw", "jigsaw",
            "orbital sander", "heat gun", "rotary hammer", "impact driver", "spirit level", "tape measure",
            "utility knife", "socket wrench", "pipe wrench", "wire stripper", "soldering iron", "glue gun",
            "workbench vice", "laser distance meter"]
SIZES = ["mini", "compact", "standard", "professional", "heavy duty"]
PROMPTS = [f"Order #{1000 + i}: the customer asked for one" for i in range(8)]


def catalog(n_items: int) -> list[str]:
    items = [f" {b} {p} {s}" for s in SIZES for b in BRANDS for p in PRODUCTS]
    if n_items > len(items):
        raise SystemExit(f"--items: at most {len(items)}")
    return items[:n_items]


def json_schema(items: list[str]) -> dict:
    return {
        "type": "object",
        "properties": {"product": {"enum": [i.strip() for i in items[:200]]},
                       "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["product", "quantity"], "additionalProperties": False,
    }


class DecodeCounter:
    """Counts llama.cpp decode calls (forward passes) of one Llama."""

    def __init__(self, llm) -> None:
        self.calls = 0
        decode = llm._ctx.decode

        def counted(batch):
            self.calls += 1
            return decode(batch)

        llm._ctx.decode = counted


def completion_run(llm, counter, prompt_ids, *, grammar=None, constraint=None, max_tokens):
    llm.reset()
    before = counter.calls
    start = time.perf_counter()
    out = llm.create_completion(
        prompt_ids, max_tokens=max_tokens, temperature=0.0, grammar=grammar,
        logits_processor=constraint.processors() if constraint is not None else None,
    )
    seconds = time.perf_counter() - start
    prompt_passes = math.ceil(len(prompt_ids) / llm.n_batch)
    tokens = [int(t) for t in llm._input_ids[len(prompt_ids):]]
    n = out["usage"]["completion_tokens"]
    return {"seconds": seconds, "tokens": n, "ids": tokens, "text": out["choices"][0]["text"],
            "passes": counter.calls - before - prompt_passes}


def skip_ahead_run(llm, prompt_ids, constraint, *, max_tokens):
    from logitgate.integrations.llama_cpp import generate

    llm.reset()  # like the other methods: the prompt is evaluated, no cache kept
    result = generate(llm, prompt_ids, constraint, max_tokens=max_tokens)
    stops = set(constraint.info.stop_token_ids)
    ids = [t for t in result.tokens if t not in stops]
    return {"seconds": result.seconds, "tokens": len(ids), "ids": ids[:-1] if result.finish_reason == "length" else ids,
            "text": result.text, "passes": result.forward_passes}


def skip_ratio(constraint, ids: list[int]) -> float:
    """Mean over the generated positions of (V - valid) / V."""
    processor = constraint.logits_processor()
    processor.begin([0])
    vocab = constraint.info.vocab_size
    ratios = []
    for i in range(len(ids) + 1):
        processor._sync(ids[:i])
        if processor.in_span:
            ratios.append((vocab - len(processor._tracker.allowed())) / vocab)
    return statistics.mean(ratios) if ratios else 0.0


def agreement(a: list[int], b: list[int]) -> float:
    length = max(len(a), len(b))
    return sum(x == y for x, y in zip(a, b)) / length if length else 1.0


def run_case(llm, counter, name, methods, prompts, rounds, progress, constraint, max_tokens):
    """methods: name -> fn(prompt_ids) -> run dict. Interleaved at the finest grain: for every
    prompt, every method runs once in turn; round 0 is a warm-up. Per method and prompt the median
    of the timed rounds is kept (robust to another process taking the cores for a moment)."""
    seconds = {m: [[] for _ in prompts] for m in methods}
    outputs = {m: [None] * len(prompts) for m in methods}
    for r in range(rounds + 1):
        for i, p in enumerate(prompts):
            for m, fn in methods.items():
                run = fn(p)
                if r == 0:
                    outputs[m][i] = run
                else:
                    seconds[m][i].append(run["seconds"])
        progress.step(f"{name} round {r}/{rounds}")
    row = {"case": name, "items": None, "prompts": len(prompts), "rounds": rounds}
    reference = outputs["logitgate"]
    for m in methods:
        medians = [statistics.median(t) for t in seconds[m]]
        tokens = [x["tokens"] for x in outputs[m]]
        row[f"{m}_tokens_per_s"] = sum(tokens) / sum(medians)
        row[f"{m}_ms"] = 1e3 * statistics.mean(medians)  # per completion
        per_round = [1e3 * statistics.mean(t[k] for t in seconds[m]) for k in range(rounds)]
        row[f"{m}_ms_min"], row[f"{m}_ms_max"] = min(per_round), max(per_round)
        row[f"{m}_forward_passes"] = statistics.mean(x["passes"] for x in outputs[m])
        row[f"{m}_tokens"] = statistics.mean(tokens)
        row[f"{m}_token_agreement"] = statistics.mean(agreement(x["ids"], y["ids"]) for x, y in zip(outputs[m], reference))
        row[f"{m}_same_text"] = statistics.mean(float(x["text"] == y["text"]) for x, y in zip(outputs[m], reference))
    row["skip_ratio"] = statistics.mean(skip_ratio(constraint, x["ids"]) for x in reference)
    passes = row["logitgate_forward_passes"]
    row["forward_passes_saved"] = row["logitgate_processor_forward_passes"] - passes
    row["forward_passes_total"] = row["logitgate_processor_forward_passes"]
    for m in methods:
        if m.startswith("gbnf"):
            row[f"speedup_vs_{m}"] = row[f"{m}_ms"] / row["logitgate_ms"]
            # the processor alone in llama-cpp-python's own loop (no skip-ahead)
            row[f"processor_speedup_vs_{m}"] = row[f"{m}_ms"] / row["logitgate_processor_ms"]
    row["examples"] = {m: outputs[m][0]["text"] for m in methods}
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 prompts, 2 rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--items", type=int, default=1200)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1,
                        help="llama.cpp threads (default 1: on a shared host a second spinning thread that loses its core stalls every pass)")
    parser.add_argument("--out")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)

    from logitgate.cli.bench_harness import Progress, emit

    try:
        import llama_cpp
    except ImportError as exc:
        result = {"benchmark": "llama_cpp", "skipped": f"llama-cpp-python is not installed: {exc}", "rows": []}
        emit(result, args.out)
        return result
    from logitgate.integrations.llama_cpp import constrain, gbnf_for_sequences, gbnf_for_strings
    from logitgate.models.tiny_gguf import tiny_llama_gguf

    prompts_text = PROMPTS[:2] if args.quick else PROMPTS
    rounds = 2 if args.quick else args.rounds
    path = tiny_llama_gguf(vocab="llama3", n_embd=args.embd, n_layer=args.layers, n_head=4, n_head_kv=2, n_ff=2 * args.embd)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=256, n_threads=args.threads, seed=0, verbose=False)
    counter = DecodeCounter(llm)
    prompts = [llm.tokenize(p.encode()) for p in prompts_text]
    items = catalog(args.items)
    progress = Progress(2 * (rounds + 1), "llama_cpp")

    sequences = [llm.tokenize(i.encode(), add_bos=False, special=False) for i in items]
    tree = constrain(llm, sequences=sequences)
    gbnf_tokens = llama_cpp.LlamaGrammar.from_string(gbnf_for_sequences(sequences), verbose=False)
    gbnf_text = llama_cpp.LlamaGrammar.from_string(gbnf_for_strings(items), verbose=False)
    max_tokens = max(map(len, sequences)) + 2
    catalog_row = run_case(llm, counter, "catalog", {
        "logitgate": lambda p: skip_ahead_run(llm, p, tree, max_tokens=max_tokens),
        "logitgate_processor": lambda p: completion_run(llm, counter, p, constraint=tree, max_tokens=max_tokens),
        "gbnf_tokens": lambda p: completion_run(llm, counter, p, grammar=gbnf_tokens, max_tokens=max_tokens),
        "gbnf_text": lambda p: completion_run(llm, counter, p, grammar=gbnf_text, max_tokens=max_tokens),
    }, prompts, rounds, progress, tree, max_tokens)
    catalog_row["items"] = len(items)

    schema = json_schema(items)
    js = constrain(llm, json=schema, disable_any_whitespace=True)
    gbnf_json = llama_cpp.LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
    json_prompts = [llm.tokenize((p + " item, as JSON:").encode()) for p in prompts_text]
    json_row = run_case(llm, counter, "json", {
        "logitgate": lambda p: skip_ahead_run(llm, p, js, max_tokens=48),
        "logitgate_processor": lambda p: completion_run(llm, counter, p, constraint=js, max_tokens=48),
        "gbnf_json": lambda p: completion_run(llm, counter, p, grammar=gbnf_json, max_tokens=48),
    }, json_prompts, rounds, progress, js, 48)
    json_row["items"] = 200

    result = {
        "benchmark": "llama_cpp", "llama_cpp_python": llama_cpp.__version__, "model": path.name,
        "vocab_size": llm.n_vocab(), "threads": args.threads, "rows": [catalog_row, json_row],
    }
    emit(result, args.out)
    if args.plot:
        from logitgate.cli.bench_harness import plot_bars

        plot_bars(result["rows"], "case", ["logitgate", "logitgate_processor", "gbnf_tokens", "gbnf_text", "gbnf_json"],
                  "llama-cpp-python: logitgate vs llama.cpp GBNF (greedy)", args.plot, ylabel="ms per completion (median)")
    print_table(result)
    return result


def print_table(result: dict) -> None:
    lines = ["| case | method | tokens/s | ms / completion | forward passes | token agreement | same text |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        for m in ("logitgate", "logitgate_processor", "gbnf_tokens", "gbnf_text", "gbnf_json"):
            if f"{m}_ms" in row:
                lines.append(f"| {row['case']} ({row['items']} items) | {m} | {row[f'{m}_tokens_per_s']:.1f} | "
                             f"{row[f'{m}_ms']:.1f} | {row[f'{m}_forward_passes']:.2f} | "
                             f"{row[f'{m}_token_agreement']:.3f} | {row[f'{m}_same_text']:.2f} |")
        lines.append(f"| {row['case']} | skip ratio {row['skip_ratio']:.5f}, forward passes saved "
                     f"{row['forward_passes_saved']:.2f} of {row['forward_passes_total']:.2f} | | | | | |")
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    main()
