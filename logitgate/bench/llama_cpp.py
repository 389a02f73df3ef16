"""logitgate in llama.cpp vs llama.cpp's own grammar sampler (GBNF, `LlamaGrammar`) on the same
constraint, with the real llama-cpp-python.

    python -m logitgate.bench.llama_cpp [--quick] [--rounds N] [--items N] [--embd E] [--layers L]
        [--threads default 1 ...] [--out FILE] [--plot FILE.png]

Model: a tiny random Llama with the real Llama-3 tokenizer (V = 128256), written as GGUF in code
(logitgate.models.tiny_gguf, cached). Cases, each over the same prompts, greedy:

- catalog: a completion that must be one of >= 1000 catalog items (brand, product, size).
  logitgate (skip-ahead loop: forced tokens fed in one batch), logitgate_processor (the logits
  processor in llama-cpp-python's own create_completion), gbnf_tokens (the catalog's token
  sequences as a GBNF trie of `<[id]>` terminals: exactly the same constraint, so greedy outputs
  must be identical), gbnf_text (the items as GBNF string literals: what a llama.cpp user writes;
  it also accepts other tokenizations, so outputs may differ).
- json: a JSON object with a product enum (the first 200 items) and a quantity: logitgate's
  xgrammar schema vs `LlamaGrammar.from_json_schema`; logitgate_drafts is the skip-ahead loop on
  a `Llama(logits_all=True)` of the same model, which also drafts the strings the grammar fixes
  (verified, so its output equals logitgate's).

Thread settings (`--threads`, each its own Llama; default: `default 1`): `default` leaves both
`n_threads` and `n_threads_batch` to llama-cpp-python (half the cores for one-token decodes, all
the cores for batches: prompts and skip-ahead's forced tokens), `N` sets both to N, `N/M` sets
n_threads=N, n_threads_batch=M. Every row names the values the Llama got.

Per method and thread setting, interleaved (each round every setting in turn, within it for each
prompt every method in turn, each run after `llm.reset()`, so every run evaluates the prompt; a
warm-up round first), the median over rounds per prompt of the wall time of one completion (prompt
included), then: ms per completion (mean over prompts), tokens/s (generated tokens / those times), forward passes (llama.cpp decode calls after the prompt, per
completion), the skip ratio ((V - valid) / V per step, mean) and token agreement with logitgate's
output (fraction of positions with the same token). The host's load average (`os.getloadavg()`,
1 minute) is sampled after every round: each row has its median and range, the JSON the values at
start and end, next to the command line that produced it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

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


def thread_setting(text: str) -> tuple[str, int | None, int | None]:
    """`default`, `N` or `N/M` -> (label, n_threads, n_threads_batch); None leaves llama-cpp-python's default."""
    if text == "default":
        return text, None, None
    try:
        n, _, m = text.partition("/")
        threads, batch = int(n), int(m or n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--threads: 'default', N or N/M, got {text!r}") from None
    if threads < 1 or batch < 1:
        raise argparse.ArgumentTypeError(f"--threads: thread counts must be >= 1, got {text!r}")
    return text, threads, batch


def run_case(name, settings, prompts, rounds, progress, max_tokens):
    """settings: [(setting, llm, constraint, {method: fn(prompt_ids) -> run dict})]. Interleaved: every
    round runs each setting in turn, and within it, for every prompt, every method once; round 0 is
    a warm-up. (Settings alternate per round, not per run: an idle Llama's threads poll for work for
    a moment and would take the other's cores.) Per method and prompt the median of the timed rounds
    is kept (robust to another process taking the cores for a moment). One row per setting."""
    seconds = {(k, m): [[] for _ in prompts] for k, (_, _, _, methods) in enumerate(settings) for m in methods}
    outputs = {(k, m): [None] * len(prompts) for k, m in seconds}
    load = []
    for r in range(rounds + 1):
        for k, (_, _, _, methods) in enumerate(settings):
            for i, p in enumerate(prompts):
                for m, fn in methods.items():
                    run = fn(p)
                    if r == 0:
                        outputs[k, m][i] = run
                    else:
                        seconds[k, m][i].append(run["seconds"])
        load.append(os.getloadavg()[0])
        progress.step(f"{name} round {r}/{rounds}")
    return [_row(name, setting, llm, constraint, methods, [seconds[k, m] for m in methods],
                 [outputs[k, m] for m in methods], prompts, rounds, load)
            for k, (setting, llm, constraint, methods) in enumerate(settings)]


def _row(name, setting, llm, constraint, methods, seconds, outputs, prompts, rounds, load):
    row = {"case": name, "threads": setting, "n_threads": llm.n_threads, "n_threads_batch": llm.n_threads_batch,
           "items": None, "prompts": len(prompts), "rounds": rounds, "load_average_1min": statistics.median(load),
           "load_average_1min_min": min(load), "load_average_1min_max": max(load)}
    reference = outputs[list(methods).index("logitgate")]
    for m, times, runs in zip(methods, seconds, outputs):
        medians = [statistics.median(t) for t in times]
        tokens = [x["tokens"] for x in runs]
        row[f"{m}_tokens_per_s"] = sum(tokens) / sum(medians)
        row[f"{m}_ms"] = 1e3 * statistics.mean(medians)  # per completion
        # the fastest and the slowest run of each prompt, averaged like the medians (so min <= ms <= max)
        row[f"{m}_ms_min"] = 1e3 * statistics.mean(min(t) for t in times)
        row[f"{m}_ms_max"] = 1e3 * statistics.mean(max(t) for t in times)
        row[f"{m}_forward_passes"] = statistics.mean(x["passes"] for x in runs)
        row[f"{m}_tokens"] = statistics.mean(tokens)
        row[f"{m}_token_agreement"] = statistics.mean(agreement(x["ids"], y["ids"]) for x, y in zip(runs, reference))
        row[f"{m}_same_text"] = statistics.mean(float(x["text"] == y["text"]) for x, y in zip(runs, reference))
    row["skip_ratio"] = statistics.mean(skip_ratio(constraint, x["ids"]) for x in reference)
    passes = row["logitgate_forward_passes"]
    row["forward_passes_saved"] = row["logitgate_processor_forward_passes"] - passes
    row["forward_passes_total"] = row["logitgate_processor_forward_passes"]
    for m in methods:
        if m.startswith("gbnf"):
            row[f"speedup_vs_{m}"] = row[f"{m}_ms"] / row["logitgate_ms"]
            # the processor alone in llama-cpp-python's own loop (no skip-ahead)
            row[f"processor_speedup_vs_{m}"] = row[f"{m}_ms"] / row["logitgate_processor_ms"]
    if "logitgate_drafts" in methods:  # skip-ahead drafting the grammar's fixed strings too
        for m in methods:
            if m.startswith("gbnf"):
                row[f"drafts_speedup_vs_{m}"] = row[f"{m}_ms"] / row["logitgate_drafts_ms"]
    row["examples"] = {m: runs[0]["text"] for m, runs in zip(methods, outputs)}
    return row


class Setting:
    """One thread setting: its Llama, decode counter, prompts and constraints."""

    def __init__(self, llama_cpp, path, label, threads, batch, prompts_text, items):
        from logitgate.integrations.llama_cpp import constrain, gbnf_for_sequences, gbnf_for_strings

        self.label = label
        self.llm = llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=256, n_threads=threads,
                                         n_threads_batch=batch, seed=0, verbose=False)
        self.counter = DecodeCounter(llm)
        self.prompts = [llm.tokenize(p.encode()) for p in prompts_text]
        self.json_prompts = [llm.tokenize((p + " item, as JSON:").encode()) for p in prompts_text]
        self.sequences = [llm.tokenize(i.encode(), add_bos=False, special=False) for i in items]
        self.tree = constrain(llm, sequences=self.sequences)
        self.gbnf_tokens = llama_cpp.LlamaGrammar.from_string(gbnf_for_sequences(self.sequences), verbose=False)
        self.gbnf_text = llama_cpp.LlamaGrammar.from_string(gbnf_for_strings(items), verbose=False)
        schema = json_schema(items)
        self.json = constrain(llm, json=schema, disable_any_whitespace=True)
        # The same model with logits at every batch position: skip-ahead then also drafts the strings
        # the grammar fixes (structured/forced.py). Its own Llama, so the other methods pay nothing for it.
        self.drafting_llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=256, n_threads=threads,
                                            n_threads_batch=batch, seed=0, verbose=False, logits_all=True)
        self.json_drafting = constrain(self.drafting_llm, json=schema, disable_any_whitespace=True)
        self.gbnf_json = llama_cpp.LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)

    def catalog_methods(self, max_tokens):
        llm, counter, tree = self.llm, self.counter, self.tree
        return {
            "logitgate": lambda p: skip_ahead_run(llm, p, tree, max_tokens=max_tokens),
            "logitgate_processor": lambda p: completion_run(llm, counter, p, constraint=tree, max_tokens=max_tokens),
            "gbnf_tokens": lambda p: completion_run(llm, counter, p, grammar=self.gbnf_tokens, max_tokens=max_tokens),
            "gbnf_text": lambda p: completion_run(llm, counter, p, grammar=self.gbnf_text, max_tokens=max_tokens),
        }

    def json_methods(self):
        llm, counter, js = self.llm, self.counter, self.json
        return {
            "logitgate": lambda p: skip_ahead_run(llm, p, js, max_tokens=48),
            "logitgate_drafts": lambda p: skip_ahead_run(self.drafting_llm, p, self.json_drafting, max_tokens=48),
            "logitgate_processor": lambda p: completion_run(llm, counter, p, constraint=js, max_tokens=48),
            "gbnf_json": lambda p: completion_run(llm, counter, p, grammar=self.gbnf_json, max_tokens=48),
        }


class JsonWriterSetting:
    """The json_writer model (logitgate/models/json_writer.py, written as GGUF by
    tiny_gguf.hf_llama_gguf): a model that writes the served benchmark's JSON records. One schema
    (json_records.SCHEMAS) per case; logitgate constrains with the compact grammar vLLM's xgrammar
    backend uses without free whitespace, llama.cpp with `LlamaGrammar.from_json_schema`."""

    def __init__(self, llama_cpp, label, threads, batch, schema, prompts):
        import xgrammar as xgr

        from logitgate.integrations.llama_cpp import constrain
        from logitgate.models.json_writer import json_writer_model
        from logitgate.models.tiny_gguf import hf_llama_gguf

        path = hf_llama_gguf(json_writer_model())
        self.label, self.prompts = label, prompts
        options = dict(model_path=str(path), n_ctx=256, n_batch=256, n_threads=threads, n_threads_batch=batch,
                       seed=0, verbose=False)
        self.llm = llama_cpp.Llama(**options)
        self.drafting_llm = llama_cpp.Llama(**options, logits_all=True)
        self.counter = DecodeCounter(self.llm)
        compact = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":")))
        self.json = constrain(self.llm, grammar=compact)
        self.json_drafting = constrain(self.drafting_llm, grammar=compact)
        self.gbnf_json = llama_cpp.LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)

    json_methods = Setting.json_methods


def json_writer_main(args, llama_cpp, settings_args, command, load_start) -> dict:
    """--model json_writer: the JSON case on the json_writer model, per schema."""
    from logitgate.bench.harness import Progress, emit
    from logitgate.models.json_records import SCHEMAS
    from logitgate.models.json_writer import json_writer_model
    from logitgate.models.json_writer_check import load
    from logitgate.models.random_prompts import random_prompts

    _, tok = load(json_writer_model())
    prompts = random_prompts(tok, 2 if args.quick else len(PROMPTS), seed=0)
    rounds = 2 if args.quick else args.rounds
    progress = Progress(len(SCHEMAS) * (rounds + 1), "llama_cpp json_writer")
    rows = []
    for name, schema in SCHEMAS.items():
        settings = [JsonWriterSetting(llama_cpp, *s, schema, prompts) for s in settings_args]
        rows += run_case(f"json_writer {name}", [(s.label, s.llm, s.json, s.json_methods()) for s in settings],
                         prompts, rounds, progress, 48)
    for row in rows:
        row["items"] = 0
    result = {"benchmark": "llama_cpp", "command": command, "llama_cpp_python": llama_cpp.__version__,
              "model": "json_writer", "cpu_count": os.cpu_count(),
              "load_average": {"start": list(load_start), "end": list(os.getloadavg())}, "rows": rows}
    emit(result, args.out)
    print_table(result)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 prompts, 2 rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--items", type=int, default=1200)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", nargs="+", type=thread_setting, default=["default", "1"],
                        help="thread settings, each its own Llama: 'default' (llama-cpp-python's n_threads and "
                             "n_threads_batch), N (both N) or N/M (n_threads/n_threads_batch); default: default 1")
    parser.add_argument("--model", choices=("tiny", "json_writer"), default="tiny",
                        help="tiny: a random Llama (catalog and JSON cases); json_writer: the trained JSON model "
                             "(the JSON case per served-benchmark schema)")
    parser.add_argument("--out")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    settings_args = [thread_setting(t) if isinstance(t, str) else t for t in args.threads]
    command = " ".join(["python", "-m", "logitgate.bench.llama_cpp", *(sys.argv[1:] if argv is None else argv)])
    load_start = os.getloadavg()

    from logitgate.bench.harness import Progress, emit

    try:
        import llama_cpp
    except ImportError as exc:
        result = {"benchmark": "llama_cpp", "skipped": f"llama-cpp-python is not installed: {exc}", "rows": []}
        emit(result, args.out)
        return result
    if args.model == "json_writer":
        return json_writer_main(args, llama_cpp, settings_args, command, load_start)
    from logitgate.models.tiny_gguf import tiny_llama_gguf

    prompts_text = PROMPTS[:2] if args.quick else PROMPTS
    rounds = 2 if args.quick else args.rounds
    path = tiny_llama_gguf(vocab="llama3", n_embd=args.embd, n_layer=args.layers, n_head=4, n_head_kv=2, n_ff=2 * args.embd)
    items = catalog(args.items)
    settings = [Setting(llama_cpp, path, *s, prompts_text, items) for s in settings_args]
    progress = Progress(2 * (rounds + 1), "llama_cpp")

    max_tokens = max(map(len, settings[0].sequences)) + 2
    rows = run_case("catalog", [(s.label, s.llm, s.tree, s.catalog_methods(max_tokens)) for s in settings],
                    settings[0].prompts, rounds, progress, max_tokens)
    for row in rows:
        row["items"] = len(items)
    json_rows = run_case("json", [(s.label, s.llm, s.json, s.json_methods()) for s in settings],
                         settings[0].json_prompts, rounds, progress, 48)
    for row in json_rows:
        row["items"] = 200

    result = {
        "benchmark": "llama_cpp", "command": command, "llama_cpp_python": llama_cpp.__version__, "model": path.name,
        "vocab_size": settings[0].llm.n_vocab(), "cpu_count": os.cpu_count(),
        "threads": [{"setting": s.label, "n_threads": s.llm.n_threads, "n_threads_batch": s.llm.n_threads_batch}
                    for s in settings],
        "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
        "rows": rows + json_rows,
    }
    emit(result, args.out)
    if args.plot:
        from logitgate.bench.harness import plot_bars

        for row in result["rows"]:
            row["label"] = f"{row['case']}, threads {row['n_threads']}/{row['n_threads_batch']}"
        plot_bars(result["rows"], "label", ["logitgate", "logitgate_drafts", "logitgate_processor", "gbnf_tokens", "gbnf_text", "gbnf_json"],
                  "llama-cpp-python: logitgate vs llama.cpp GBNF (greedy)", args.plot, ylabel="ms per completion (median)",
                  subtitle="llama.cpp threads per bar group (n_threads/n_threads_batch)")
    print_table(result)
    return result


def print_table(result: dict) -> None:
    lines = ["| case | threads | method | tokens/s | ms / completion | forward passes | token agreement | same text |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        for m in ("logitgate", "logitgate_drafts", "logitgate_processor", "gbnf_tokens", "gbnf_text", "gbnf_json"):
            if f"{m}_ms" in row:
                lines.append(f"| {row['case']} ({row['items']} items) | {row['n_threads']}/{row['n_threads_batch']} | "
                             f"{m} | {row[f'{m}_tokens_per_s']:.1f} | "
                             f"{row[f'{m}_ms']:.1f} | {row[f'{m}_forward_passes']:.2f} | "
                             f"{row[f'{m}_token_agreement']:.3f} | {row[f'{m}_same_text']:.2f} |")
        lines.append(f"| {row['case']} | {row['n_threads']}/{row['n_threads_batch']} | skip ratio "
                     f"{row['skip_ratio']:.5f}, forward passes saved {row['forward_passes_saved']:.2f} of "
                     f"{row['forward_passes_total']:.2f}, load average {row['load_average_1min']:.2f} | | | | | |")
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    main()
