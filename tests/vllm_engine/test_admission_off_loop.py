"""Issue 30, item 6: a large tree request no longer holds vLLM's API server. A ~12 MB token trie
was admitted on the server's event loop (json.loads and the checks: seconds on this host), so
/health and every other client waited; now it is parsed in logitgate's admission process while
the loop keeps answering. Measured against the floor, the same bytes in an argument vLLM ignores
(its own request parsing), on a server with vLLM's defaults and the default tree limits
(logitgate/bench/tree_admission_stall.py, whose benchmark reports the same at 40 MB)."""
from __future__ import annotations

import pytest

from logitgate.bench.served_server import running_server
from logitgate.bench.tree_admission_stall import health_stall, trie_text
from tests.helpers.vllm_runtime import needs_vllm_cpu

pytestmark = needs_vllm_cpu

MEGABYTES = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


def test_a_large_tree_does_not_hold_the_event_loop(server):
    from logitgate.models.demo import TARGET_DIR, demo_prompt

    model, prompt = str(TARGET_DIR), demo_prompt("Krakow")
    floor = health_stall(server.url, "floor", trie_text(MEGABYTES), model, prompt)
    assert floor["status"] == 200, floor
    bound = max(1.0, 2 * floor["max_health_s"])
    # Read whole, then refused (a token past the vocabulary in the last leaf): admission alone.
    refused = health_stall(server.url, "invalid", trie_text(MEGABYTES, bad_last_token=True), model, prompt)
    assert refused["status"] == 400 and "token 300 at position 23 is >= vocab_size 260" in refused["error"], refused
    served = health_stall(server.url, "valid", trie_text(MEGABYTES), model, prompt)
    assert served["status"] == 200, served
    assert refused["max_health_s"] <= bound and served["max_health_s"] <= bound, (floor, refused, served)
    # The admission processes did the parsing, each started once by its first large tree: the API
    # server's, and the engine core's (the served tree's compile; issue 36.3).
    started = [line for line in server.log_text().splitlines() if "logitgate tree admission process started" in line]
    parents = {line.split("for pid ")[1].split(")")[0] for line in started}
    assert len(started) == len(parents) == 2, started
