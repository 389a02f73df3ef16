"""How long a large tree request holds vLLM's API server: /health asked every 20 ms from a thread
while one request is sent, answered and done; the longest wait for an answer is the stall. Used by
tests/vllm_engine/test_admission_off_loop.py and scripts/tree_admission_stall.py (issue 30, item 6).

The trees are token tries over the demo target's byte tokens (end token 257), as large as asked:
`valid` ones are served (max_tokens 1), `invalid` ones carry one token past the vocabulary in their
last leaf, so admission reads all of them before refusing (400) and no engine work follows. The
floor is the same number of bytes in an argument vLLM ignores (`vllm_xargs` {"note": ...}): what
vLLM's own request parsing costs the loop."""
from __future__ import annotations

import json
import threading
import time
import urllib.request

from tests.helpers.server_helpers import post

__all__ = ["STALL_CASES", "api_server_rss_mb", "health_stall", "stream_stall", "trie_body", "trie_text"]

LEAF_TOKENS = 24
STALL_CASES = ("floor", "invalid", "valid")


def trie_text(megabytes: float, bad_last_token: bool = False, variant: int = 0) -> str:
    """A TokenTreePayload of about `megabytes` MB: leaves of LEAF_TOKENS printable-ASCII tokens;
    another `variant` is other text (admission recognises a tree sent again by its hash)."""
    leaf_bytes = len(json.dumps({"name": "v0-leaf0000000", "tokens": [100] * LEAF_TOKENS})) + 2
    count = int(megabytes * 1e6 / leaf_bytes)
    leaves = [{"name": f"v{variant}-leaf{i}", "tokens": [32 + (i * 7 + j * 13) % 95 for j in range(LEAF_TOKENS)]}
              for i in range(count)]
    if bad_last_token:
        leaves[-1]["tokens"][-1] = 300  # >= the demo vocabulary (260): found only after every leaf is read
    return json.dumps({"modelId": "demo", "descriptors": [{"path": "p", "leaves": leaves}]})


def trie_body(case: str, text: str, model: str, prompt: list[int]) -> dict:
    xargs = {"note": text} if case == "floor" else {"token_trie": text, "end_token_id": 257}
    return {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "vllm_xargs": xargs}


def health_stall(url: str, case: str, text: str, model: str, prompt: list[int]) -> dict:
    """{"status", "seconds" (the request), "max_health_s", "health_checks"} for one request."""
    waits: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            start = time.perf_counter()
            with urllib.request.urlopen(f"{url}/health", timeout=120) as reply:
                reply.read()
            waits.append(time.perf_counter() - start)
            time.sleep(0.02)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    time.sleep(0.2)  # a few answers before the request: the idle latency
    start = time.perf_counter()
    status, answer = post(f"{url}/v1/completions", trie_body(case, text, model, prompt), timeout=600)
    seconds = time.perf_counter() - start
    done.set()
    prober.join(130)
    return {"status": status, "seconds": round(seconds, 3), "max_health_s": round(max(waits), 3),
            "health_checks": len(waits), "error": str(answer.get("error", {}).get("message", answer))[:200]}


def _stream(url: str, model: str, prompt: list[int] | str, arrivals: list[float], max_tokens: int) -> None:
    """One plain streamed completion; the time each of its chunks arrives."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        for line in reply:
            if line.startswith(b"data: {"):
                arrivals.append(time.perf_counter())


def stream_stall(url: str, model: str, prompt: list[int] | str, during, max_tokens: int = 100) -> dict:
    """How long plain streams stop while `during()` runs: plain streamed completions, one after
    another, from before `during` starts until after it ends; the longest wait between two chunks
    (across streams) that overlaps `during`. {"during_s", "max_gap_s", "chunks", "result"}."""
    arrivals: list[float] = []
    done = threading.Event()

    def streams() -> None:
        while not done.is_set():
            _stream(url, model, prompt, arrivals, max_tokens)

    streamer = threading.Thread(target=streams, daemon=True)
    streamer.start()
    while len(arrivals) < 20:  # streaming before `during` starts
        time.sleep(0.05)
    start = time.perf_counter()
    result = during()
    end = time.perf_counter()
    settle = len(arrivals)
    while len(arrivals) < settle + 10:  # the first chunks after: a stall across the end is measured whole
        time.sleep(0.05)
    done.set()
    streamer.join(600)
    times = sorted(arrivals)
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
    return {"during_s": round(end - start, 3), "max_gap_s": round(max(gaps), 3), "chunks": len(gaps), "result": result}


def api_server_rss_mb(pid: int) -> float:
    """The resident memory of the process `pid` (vLLM's API server), in MB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")
