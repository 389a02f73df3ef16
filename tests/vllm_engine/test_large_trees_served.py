"""Issue 36, defects 3 and 5, on `vllm serve` with vLLM's defaults (API server, engine core and
worker in processes of their own) on the embedded demo target, with the default tree limits:

- 36.3: a large tree's compile in the engine core no longer stops every stream. Its parse (json.loads
  and the per-leaf checks, which hold the GIL) ran on the engine core's compile thread; now it runs
  in the engine core's own admission process and the trie is built from its arrays. Plain streams
  are measured while a 30 MB token trie is admitted, compiled and served, against the floor: the
  same bytes in an argument vLLM ignores (vLLM's own cost of moving them).
- 36.5: the API server keeps no memory of large trees (+1.2 GB after 20 tries before): glibc kept
  the freed 30 MB buffers (request bodies alive together while their trees wait for admission;
  the admission's whole-text encodes on asyncio's executor threads) in its heaps. Now buffers of
  4 MB or more are mapped and unmapped (admission._large_buffers_returned), a text is encoded a
  slice at a time, and the heaps are trimmed after the last large admission. What stayed after that
  (+431-540 MB after 20 tries) were the tree texts themselves: each request's resolve made a class
  (args.tree_request_for), a reference cycle that held the text until the next full GC.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from logitgate.bench.served_server import post, running_server, vllm_serve_command
from logitgate.bench.tree_admission_stall import api_server_rss_mb, stream_stall, trie_body, trie_text
from tests.helpers.vllm_runtime import needs_vllm_cpu

pytestmark = needs_vllm_cpu

MEGABYTES = 30


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("log") / "server.log", command=vllm_serve_command) as s:
        yield s


@pytest.fixture(scope="module")
def demo():
    from logitgate.models.demo import TARGET_DIR, demo_prompt

    return str(TARGET_DIR), demo_prompt("Krakow")


def send(server, demo, case: str, text: str) -> tuple[int, dict]:
    return post(f"{server.url}/v1/completions", trie_body(case, text, *demo), timeout=600)


def test_a_large_tree_compile_does_not_stop_plain_streams(server, demo):
    """Plain streams' longest gap while a 30 MB trie is served stays within max(1 s, 2 x floor +
    0.25 s). One pair of measurements is noise on a shared 2-core host (a fresh-clone CI failed one
    at 1.675 s against 1.628: floor 0.689 s over 4.3 s, tree 1.675 s over 10.2 s), so up to three
    pairs are measured, new texts each, and one within the bound passes; the parse this guards
    against held the GIL on every try."""
    model, prompt = demo
    assert send(server, demo, "valid", trie_text(1, variant=100))[0] == 200  # both admission processes started
    pairs = []
    for attempt in range(3):
        floor = stream_stall(server.url, model, prompt, lambda: send(server, demo, "floor", trie_text(MEGABYTES, variant=1 + 2 * attempt)))
        served = stream_stall(server.url, model, prompt, lambda: send(server, demo, "valid", trie_text(MEGABYTES, variant=2 + 2 * attempt)))
        assert floor["result"][0] == 200 and served["result"][0] == 200, (floor, served)
        bound = max(1.0, 2 * floor["max_gap_s"] + 0.25)
        pairs.append((floor["max_gap_s"], served["max_gap_s"], bound))
        print("plain streams' longest gap: floor", floor, "tree", served)  # noqa: T201 - the numbers, with -s
        if served["max_gap_s"] <= bound:
            break
    assert pairs[-1][1] <= pairs[-1][2], pairs  # (floor gap, tree gap, bound) per try
    # One admission process for the API server, one for the engine core: each started once.
    started = [line for line in server.log_text().splitlines() if "logitgate tree admission process started" in line]
    parents = {line.split("for pid ")[1].split(")")[0] for line in started}
    assert len(started) == len(parents) == 2, started


def test_large_trees_leave_no_memory_in_the_api_server(server, demo):
    """8 concurrent 30 MB tries (each new text): the API server's RSS 4 s after them (past its heap
    trim, admission.TRIM_AFTER_S) stays within 40 MB of before (a 1 MB tree first; one text kept
    is 31 MB). Before the fix each request's resolve made a class holding its tree text (a
    reference cycle, freed only by a full GC): +81 and +161 MB here; after 20 such tries the API
    server kept 18 texts. Now +5 MB."""
    assert send(server, demo, "valid", trie_text(1, variant=101))[0] == 200  # the admission's imports, before
    time.sleep(2)
    before = api_server_rss_mb(server.proc.pid)
    texts = [trie_text(MEGABYTES, variant=10 + i) for i in range(8)]
    with ThreadPoolExecutor(len(texts)) as pool:
        statuses = [status for status, _ in pool.map(lambda text: send(server, demo, "valid", text), texts)]
    del texts
    assert statuses == [200] * 8, statuses
    time.sleep(4)
    grown = round(api_server_rss_mb(server.proc.pid) - before)
    print("API server RSS before", round(before), "MB, after 8 tries +", grown)  # noqa: T201
    assert grown <= 40, (before, grown)
