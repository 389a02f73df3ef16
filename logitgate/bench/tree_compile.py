"""Tree compile time on hostile and ordinary inputs (issue 22.2): JSON text in, TreeDFA out, CPU,
no cache, V = 128256. Cases:

- chain_N: a TokenTreePayload with one leaf of N tokens (one node per level: the old level-by-level
  build paid a numpy round per token);
- unreachable_key_N: a prefix dict whose only key has N parts and no intermediate keys (a 1-node tree);
- wide_K: K items of 3-8 random tokens (the catalog shape: few levels, many nodes per level);
- prefix_dict_K: a K-key RTP-LLM prefix dict (K/4 items of 4 tokens, every prefix a key).

Limits are raised (LOGITGATE_TREE_MAX_*) so that the hostile inputs are compiled, not refused.

    python -m logitgate.bench.tree_compile [--repeats 3] [--quick] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

V = 128256


def chain_payload(n: int) -> str:
    tokens = (1000 + np.arange(n) % 9000).tolist()
    return json.dumps({"modelId": "m", "descriptors": [{"path": "p", "leaves": [{"name": "x", "tokens": tokens}]}]})


def unreachable_key(n: int) -> str:
    key = "225_" + "_".join(["1"] * n)
    return json.dumps({"start_token_id": 225, "end_token_id": 2, "prefix_dict": {key: [3]}})


def wide_payload(k: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    leaves = [{"name": str(i), "tokens": rng.integers(3, V, rng.integers(3, 9)).tolist()} for i in range(k)]
    return json.dumps({"modelId": "m", "descriptors": [{"path": "p", "leaves": leaves}]})


def prefix_dict(k: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    items = rng.integers(3, V, (k // 4, 4))
    entries: dict[str, list[int]] = {}
    for item in items.tolist():
        key = "225"
        for tok in item:
            entries.setdefault(key, []).append(tok)
            key = f"{key}_{tok}"
        entries.setdefault(key, []).append(2)
    return json.dumps({"start_token_id": 225, "end_token_id": 2, "prefix_dict": entries})


def time_case(build, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        build()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the smaller sizes only")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    for name in ("BYTES", "NODES", "DEPTH"):
        os.environ[f"LOGITGATE_TREE_MAX_{name}"] = str(1 << 40)
    from logitgate.structured.tree import TreeDFA

    def trie(text: str):
        return lambda: TreeDFA.from_token_trie(text, end_token_id=2, vocab_size=V, device="cpu", cache=False)

    def pdict(text: str):
        return lambda: TreeDFA.from_prefix_dict(text, vocab_size=V, device="cpu", cache=False)

    sizes = [100_000] if args.quick else [100_000, 300_000, 500_000]
    cases = [(f"chain_{n}", trie(chain_payload(n))) for n in sizes]
    cases.append(("unreachable_key_300000", pdict(unreachable_key(300_000))))
    cases.append(("wide_20000", trie(wide_payload(20_000))))
    cases.append((f"prefix_dict_{400_000 if args.quick else 1_000_000}", pdict(prefix_dict(400_000 if args.quick else 1_000_000))))
    trie(chain_payload(10))()  # warm up (numba's first call loads its cached kernels)
    results = {}
    for name, build in cases:
        results[name] = time_case(build, args.repeats)
        print(f"{name:28s} {results[name]:8.3f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
