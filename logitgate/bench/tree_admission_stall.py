"""How long one large tree request holds vLLM's API server (issue 30, item 6), how long it stops
plain streams, and what concurrent large trees cost (issue 36, defects 3 and 5): the probes the
engine tests use (tests/vllm_engine/test_admission_off_loop.py, test_large_trees_served.py,
test_first_mirror_stall.py) and the benchmark that reports them at 40 MB.

    python -m logitgate.bench.tree_admission_stall [--megabytes 40] [--repeats 3] [--streams] [--concurrent N]
                                                  [--python PATH] [--log FILE] [--out FILE]

The trees are token tries over the demo target's byte tokens (end token 257), as large as asked:
`valid` ones are served (max_tokens 1), `invalid` ones carry one token past the vocabulary in their
last leaf, so admission reads all of them before refusing (400) and no engine work follows. The
floor is the same number of bytes in an argument vLLM ignores (`vllm_xargs` {"note": ...}): what
vLLM's own request parsing costs the loop. The stall: /health asked every 20 ms from a thread while
one request is sent, answered and done; the longest wait for an answer (`health_stall`).

The benchmark starts the OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`,
vLLM's defaults: API server, engine core and worker in processes of their own) on the embedded demo
target with the default tree limits, then sends floor, invalid and valid requests one at a time;
`--repeats` rounds, each on new text. Reported per case and round: the longest /health wait, the
request's time and status. `--streams`: the same floor and valid requests again, each while plain
streamed completions run back to back (`stream_stall`): the longest wait between two of their
chunks. `--concurrent N`: N valid tries (new text each) sent at once: the seconds until all are
answered and the API server's RSS before and 12 s after. The measuring runs in `--python` (the
interpreter with vLLM), started as `python -m logitgate.bench.tree_admission_stall` with this
logitgate first on its PYTHONPATH, which the server inherits; the JSON names the logitgate the
server imports.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import envs
from .harness import package_env
from .served_server import post, running_server

__all__ = ["STALL_CASES", "api_server_rss_mb", "health_stall", "main", "stream_stall", "trie_body", "trie_text"]

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


def child(megabytes: float, repeats: int, log: str | None, streams: bool = False, concurrent: int = 0) -> dict:
    from ..models.demo import TARGET_DIR, demo_prompt

    model, prompt = str(TARGET_DIR), demo_prompt("Krakow")

    # The server runs as `python -m` from this directory with this process's PYTHONPATH: the logitgate it imports.
    found = subprocess.run([sys.executable, "-c", "import logitgate; print(logitgate.__file__)"], capture_output=True, text=True)
    result: dict = {"logitgate": str(Path(found.stdout.strip()).parent), "megabytes": round(len(trie_text(megabytes)) / 1e6, 1)}
    with tempfile.TemporaryDirectory() as tmp, running_server(Path(log or Path(tmp) / "server.log")) as server:
        for repeat in range(repeats):  # each round's trees are new text (no admission cache hit)
            for case in STALL_CASES:
                text = trie_text(megabytes, case == "invalid", variant=repeat)
                run = health_stall(server.url, case, text, model, prompt)
                result.setdefault(case, []).append(run)
            if streams:
                for case in ("floor", "valid"):
                    text = trie_text(megabytes, variant=1000 + repeat)
                    run = stream_stall(server.url, model, prompt,
                                       lambda: post(f"{server.url}/v1/completions", trie_body(case, text, model, prompt), timeout=1200))
                    result.setdefault(f"streams_{case}", []).append({"max_gap_s": run["max_gap_s"], "seconds": run["during_s"],
                                                                   "status": run["result"][0]})
        if concurrent:
            texts = [trie_text(megabytes, variant=2000 + i) for i in range(concurrent)]
            before = api_server_rss_mb(server.proc.pid)
            start = time.perf_counter()
            with ThreadPoolExecutor(concurrent) as pool:
                statuses = list(pool.map(lambda text: post(f"{server.url}/v1/completions",
                                                           trie_body("valid", text, model, prompt), timeout=3600)[0], texts))
            seconds = time.perf_counter() - start
            del texts
            time.sleep(12)  # well past the API server's heap trim (1 s after its last large admission)
            result["concurrent"] = {"requests": concurrent, "seconds": round(seconds, 1), "statuses": statuses,
                                    "rss_before_mb": round(before), "rss_after_mb": round(api_server_rss_mb(server.proc.pid))}
    for case in STALL_CASES:
        result[f"{case}_max_health_s"] = [run["max_health_s"] for run in result.get(case, [])]
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=40.0, help="size of each request's tree text")
    parser.add_argument("--python", default=envs.read("LOGITGATE_VLLM_PYTHON") or sys.executable,
                        help="the interpreter with vLLM (default: LOGITGATE_VLLM_PYTHON, else this one)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the three cases, each on new text")
    parser.add_argument("--streams", action="store_true", help="also measure plain streams during floor and valid")
    parser.add_argument("--concurrent", type=int, default=0, help="also send this many valid tries at once")
    parser.add_argument("--log", help="keep the server's log in this file")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.child:
        result = child(args.megabytes, args.repeats, args.log, args.streams, args.concurrent)
    else:
        log = ["--log", str(Path(args.log).resolve())] if args.log else []
        extra = [*(["--streams"] if args.streams else []), "--concurrent", str(args.concurrent)]
        child_args = ["--child", "--megabytes", str(args.megabytes), "--repeats", str(args.repeats), *extra, *log]
        proc = subprocess.run([args.python, "-m", "logitgate.bench.tree_admission_stall", *child_args],
                              capture_output=True, text=True, env=package_env())
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    text = json.dumps(result, indent=None if args.child else 2)
    if args.out and not args.child:
        Path(args.out).write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
