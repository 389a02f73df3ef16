"""How long one large tree request holds vLLM's API server (issue 30, item 6), how long it stops
plain streams, and what concurrent large trees cost (issue 36, defects 3 and 5).

    python scripts/tree_admission_stall.py [--megabytes 40] [--repeats 3] [--streams] [--concurrent N]
                                           [--python PATH] [--log FILE] [--out FILE]

Starts the OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`, vLLM's defaults:
API server, engine core and worker in processes of their own) on the embedded demo target with the
default tree limits, then sends, one at a time, a request whose `vllm_xargs` carry as many bytes:
`floor` (an argument vLLM ignores: vLLM's own request parsing), `valid` (a token trie, served with
max_tokens 1) and `invalid` (a token trie whose last token is past the vocabulary: read whole, then
a 400), while a thread asks /health every 20 ms (tests/vllm_engine/admission_stall.py); `--repeats`
rounds, each on new text. Reported per case and round: the longest /health wait, the request's time
and status. `--streams`: the same floor and valid requests again, each while plain streamed
completions run back to back (admission_stall.stream_stall): the longest wait between two of their
chunks. `--concurrent N`: N valid tries (new text each) sent at once: the seconds until all are
answered and the API server's RSS before and 12 s after. Which logitgate the server runs is
the one `python -m` imports from the current directory (a checkout's root: its own); the JSON
names it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/ (the server helpers); logitgate is the interpreter's


def child(megabytes: float, repeats: int, log: str | None, streams: bool = False, concurrent: int = 0) -> dict:
    from logitgate.models.demo import TARGET_DIR, demo_prompt
    from tests.helpers.server_helpers import post, running_server
    from tests.vllm_engine.admission_stall import (
        STALL_CASES,
        api_server_rss_mb,
        health_stall,
        stream_stall,
        trie_body,
        trie_text,
    )

    model, prompt = str(TARGET_DIR), demo_prompt("Krakow")

    # The server runs as `python -m` from this directory, so it imports the logitgate found from here.
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
    parser.add_argument("--python", default=os.environ.get("LOGITGATE_VLLM_PYTHON", sys.executable),
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
        proc = subprocess.run([args.python, __file__, "--child", "--megabytes", str(args.megabytes),
                               "--repeats", str(args.repeats), *extra, *log], capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    text = json.dumps(result, indent=None if args.child else 2)
    if args.out and not args.child:
        Path(args.out).write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
