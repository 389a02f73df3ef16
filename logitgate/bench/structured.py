"""Per-step grammar-bitmask time for a batch of structured requests: StructuredOutputManager vs
filling the same rows one by one, with and without draft tokens — one process, medians of many runs.

The batch is half JSON-schema requests and half tree (prefix-dict) requests when logitgate.TreeDFA
is importable, otherwise all JSON (the JSON reported says which). Baselines, same rows, same states:
- JSON rows: plain `xgrammar.GrammarMatcher`s, one `fill_next_token_bitmask` per row, drafts accepted
  one by one and rolled back afterwards (what vLLM's grammar_bitmask loop does).
- tree rows: TreeDFA's scalar API, `allowed(state)` packed into the row one row at a time (what
  RTP-LLM does with its dense host mask), stepping through the drafts.

    python -m logitgate.bench.structured [--quick] [--requests 64] [--vocab 32000] [--drafts 4] [--out F] [--plot F.png]
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import random
import string

import numpy as np
import torch
import xgrammar as xgr

import logitgate
from logitgate.bench.harness import Progress, emit, plot_bars, round_robin
from logitgate.structured import StructuredOutputManager, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
    },
    "required": ["id", "name", "tags", "score"],
}


def synthetic_vocab(size: int, rng: random.Random) -> list[bytes]:
    """256 byte tokens, then random pieces shaped like a BPE vocabulary's (mostly words, some with a
    leading space, some digit runs, a few with JSON punctuation), then a stop token."""
    pieces: set[bytes] = set()
    while len(pieces) < size - 257:
        kind = rng.random()
        if kind < 0.8:
            piece = (" " if rng.random() < 0.5 else "") + "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 6)))
        elif kind < 0.92:
            piece = "".join(rng.choices(string.digits, k=rng.randint(2, 4)))
        else:
            piece = "".join(rng.choices(string.ascii_lowercase + ' "{}[]:,.', k=rng.randint(2, 4)))
        pieces.add(piece.encode())
    return [bytes([i]) for i in range(256)] + sorted(pieces) + [b"</s>"]


def make_encoder(vocab: list[bytes]):
    index = {piece: i for i, piece in enumerate(vocab[:-1])}

    def encode(text: str) -> list[int]:
        data, out, i = text.encode(), [], 0
        while i < len(data):
            for length in range(6, 0, -1):
                token = index.get(data[i : i + length])
                if token is not None:
                    out.append(token)
                    i += length
                    break
        return out

    return encode


def json_text(rng: random.Random) -> str:
    tags = ", ".join(f'"{"".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8)))}"' for _ in range(rng.randint(1, 4)))
    name = "".join(rng.choices(string.ascii_lowercase + " ", k=rng.randint(3, 12)))
    return f'{{"id": {rng.randint(0, 10**6)}, "name": "{name}", "tags": [{tags}], "score": {rng.random() * 100:.3f}}}'


def tree_config(rng: random.Random, vocab_size: int, end: int, paths: int = 256, depth: int = 10) -> tuple[dict, list[list[int]]]:
    """An RTP-LLM prefix dict over `paths` random token paths sharing prefixes (few roots)."""
    start = 1
    heads = [rng.randrange(300, vocab_size - 1) for _ in range(8)]
    seqs = [[rng.choice(heads)] + [rng.randrange(300, vocab_size - 1) for _ in range(depth - 1)] for _ in range(paths)]
    prefix: dict[str, set[int]] = {}
    for seq in seqs:
        key = str(start)
        for t in seq:
            prefix.setdefault(key, set()).add(t)
            key = f"{key}_{t}"
        prefix[key] = {end}
    config = {"start_token_id": start, "end_token_id": end, "sep": "_", "prefix_dict": {k: sorted(v) for k, v in prefix.items()}}
    return config, seqs


def build(args, rng: random.Random):
    vocab = synthetic_vocab(args.vocab, rng)
    eos = len(vocab) - 1
    encode = make_encoder(vocab)
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[eos])
    tree_cls = getattr(logitgate, "TreeDFA", None)
    n_tree = args.requests // 2 if tree_cls is not None else 0
    manager = StructuredOutputManager(info, vocab_size=len(vocab), num_speculative_tokens=args.drafts)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(SCHEMA)
    config, seqs = tree_config(rng, len(vocab), eos)
    tree = tree_cls.from_prefix_dict(config, vocab_size=len(vocab)) if n_tree else None
    requests = []  # (request id, kind, tokens so far, continuation)
    for i in range(args.requests):
        if i < n_tree:
            seq = rng.choice(seqs) + [eos]
            pos = rng.randint(0, len(seq) - args.drafts - 1)
            requests.append((f"tree{i}", "tree", seq[:pos], seq[pos:]))
            manager.add_request(f"tree{i}", StructuredOutputsParams(prefix_dict=config))
        else:
            tokens = encode(json_text(rng)) + [eos]
            pos = rng.randint(0, len(tokens) - args.drafts - 1)
            requests.append((f"json{i}", "json", tokens[:pos], tokens[pos:]))
            manager.add_request(f"json{i}", StructuredOutputsParams(json=SCHEMA))
    for request_id, _, prefix, _ in requests:
        manager.wait(request_id)
        assert manager.accept_tokens(request_id, prefix), request_id
    # The baselines' own states: plain matchers for JSON, TreeDFA node ids for trees.
    states = []
    for _, kind, prefix, _ in requests:
        if kind == "json":
            matcher = xgr.GrammarMatcher(compiled)
            assert all(matcher.accept_token(t) for t in prefix)
            states.append(matcher)
        else:
            node = tree.root
            for t in prefix:
                node = tree.step(node, t)
            states.append(node)
    return manager, requests, states, tree, len(vocab)


def baseline_rows(requests, states, tree, vocab_size: int, spec: dict[str, list[int]]) -> torch.Tensor:
    rows = sum(1 + len(spec.get(r[0], ())) for r in requests)
    # Allocated as the manager does (numpy fill), so the comparison is about filling rows.
    bitmask = torch.from_numpy(np.full((rows, (vocab_size + 31) // 32), -1, dtype=np.int32))
    row = 0
    for (request_id, kind, _, _), state in zip(requests, states):
        drafts = spec.get(request_id, [])
        if kind == "json":
            for k in range(len(drafts) + 1):
                state.fill_next_token_bitmask(bitmask, row + k)
                if k < len(drafts):
                    state.accept_token(drafts[k])
            if drafts:
                state.rollback(len(drafts))
        else:
            node = state
            for k in range(len(drafts) + 1):
                logitgate.fill_bitmask_row(bitmask, row + k, tree.allowed(node), vocab_size)
                if k < len(drafts):
                    node = tree.step(node, drafts[k])
        row += 1 + len(drafts)
    return bitmask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--drafts", type=int, default=4)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--plot")
    args = parser.parse_args()
    repeats = 7 if args.quick else 41
    rng = random.Random(0)
    manager, requests, states, tree, vocab_size = build(args, rng)
    ids = [r[0] for r in requests]
    rows = []
    progress = Progress(2, "structured")
    for n_drafts in (0, args.drafts):
        progress.step(f"{len(ids)} requests, {n_drafts} drafts each")
        spec = {r[0]: r[3][:n_drafts] for r in requests} if n_drafts else {}
        ours = manager.grammar_bitmask(ids, spec)
        reference = baseline_rows(requests, states, tree, vocab_size, spec)
        assert torch.equal(ours, reference), "the manager and the baseline disagree"
        runs = round_robin({
            "manager": lambda: manager.grammar_bitmask(ids, spec),
            "one_by_one": lambda: baseline_rows(requests, states, tree, vocab_size, spec),
        }, repeats)
        t_manager, t_base = runs["manager"].median, runs["one_by_one"].median
        rows.append({
            "case": f"{len(ids)} requests, {n_drafts} drafts",
            "rows": int(ours.shape[0]),
            **runs["manager"].fields("manager"),
            **runs["one_by_one"].fields("one_by_one"),
            "manager_us_per_row": t_manager * 1e6 / ours.shape[0],
            "speedup_vs_one_by_one": t_base / t_manager,
        })
    manager.close()
    n_tree = sum(r[1] == "tree" for r in requests)
    result = {
        "benchmark": "structured grammar_bitmask per step",
        "vocab_size": vocab_size,
        "mix": f"{len(requests) - n_tree} JSON-schema + {n_tree} tree requests"
        + ("" if n_tree else " (logitgate.TreeDFA not importable: all JSON)"),
        "baseline": "rows filled one by one: plain xgrammar GrammarMatcher (JSON), TreeDFA.allowed + pack (tree)",
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "xgrammar": importlib.metadata.version("xgrammar"),
        "repeats": repeats,
        "results": rows,
    }
    emit(result, args.out)
    if args.plot:
        plot_bars(rows, "case", ["manager", "one_by_one"], f"grammar bitmask per decode step (V={vocab_size})", args.plot)


if __name__ == "__main__":
    main()
