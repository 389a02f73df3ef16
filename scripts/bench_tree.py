"""Tree decode on CPU: one constrained greedy step over a catalog tree (semantic-ID style items of 3-8
tokens, B=64 rows two tokens into their items), logitgate against, in the same process:

- rtp_style: RTP-LLM's step — string keys ("1_1003_1290") looked up in a dict, a dense bool [B, V]
  mask built on the host (one vectorised index_put, friendlier than RTP's per-token loop), masked_fill;
- hf: transformers' PrefixConstrainedLogitsProcessor with a prefix -> allowed-tokens dict;
- xgrammar: an equivalent EBNF alternation of the items (a subset: compiling the full catalog takes
  minutes here), batch_fill_next_token_bitmask + apply_token_bitmask_inplace;
- logitgate dense: TreeDFA.fill_bitmask + apply_token_bitmask_inplace;
- logitgate sparse: TreeDFA.candidates + gather + argmax over the candidates only.

"constrain" is the masking alone; "greedy" adds the argmax that picks the token. Also: the time to
compile a ~1M-entry prefix dict (from a dict and from JSON text), and TreeDFA.advance.

    python scripts/bench_tree.py [--quick] [--items N] [--xgrammar-items N] [--out FILE] [--plot FILE.png]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numba
import numpy as np
import torch

import logitgate
from logitgate import TreeDFA
from logitgate.backends.cpu.threads import set_thread_cap
from logitgate.cli.bench_harness import Progress, emit, plot_bars, time_runs

START, END = 1, 2
CODEBOOK, BASE = 256, 1000  # item token j of an item comes from codebook j: BASE + j*CODEBOOK + code
BATCH, DEPTH = 64, 2


def make_catalog(n_items: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Distinct items of 3-8 tokens; codes are skewed (u**2) so prefixes are shared as in real catalogs."""
    rng = np.random.default_rng(seed)
    items: dict[tuple[int, ...], None] = {}
    while len(items) < n_items:
        lengths = rng.integers(3, 9, n_items)
        codes = (CODEBOOK * rng.random((n_items, 8)) ** 2).astype(np.int64)
        tokens = BASE + np.arange(8) * CODEBOOK + codes
        for row, length in zip(tokens.tolist(), lengths.tolist()):
            items.setdefault(tuple(row[:length]))
            if len(items) == n_items:
                break
    return list(items)


def prefix_dict_config(items: list[tuple[int, ...]]) -> dict:
    """The RTP-LLM config of a catalog: every prefix -> its next tokens (+ the end token where an
    item ends)."""
    allowed: dict[tuple[int, ...], set[int]] = {}
    for item in items:
        for i in range(len(item)):
            allowed.setdefault(item[:i], set()).add(item[i])
        allowed.setdefault(item, set()).add(END)
    prefix_dict = {"_".join(map(str, (START, *p))): sorted(c) for p, c in allowed.items()}
    return {"start_token_id": START, "end_token_id": END, "sep": "_", "prefix_dict": prefix_dict}


def batch_prefixes(items: list[tuple[int, ...]], seed: int = 1) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    return [items[i][:DEPTH] for i in rng.integers(0, len(items), BATCH)]


# ---- the baselines ------------------------------------------------------------------------------


def rtp_style(config: dict, prefixes, vocab: int):
    prefix_dict, end = config["prefix_dict"], config["end_token_id"]
    keys = ["_".join(map(str, (START, *p))) for p in prefixes]

    def constrain(logits: torch.Tensor) -> None:
        cands = [prefix_dict.get(k) or [end] for k in keys]  # string keys, end-token fallback
        rows = torch.repeat_interleave(torch.arange(len(keys)), torch.tensor([len(c) for c in cands]))
        cols = torch.tensor([t for c in cands for t in c])
        mask = torch.ones(len(keys), vocab, dtype=torch.bool)  # dense host mask, True = banned
        mask[rows, cols] = False
        logits.masked_fill_(mask.to(logits.device), float("-inf"))

    def update(tokens: torch.Tensor) -> list[str]:
        return [k + "_" + str(t) for k, t in zip(keys, tokens.tolist())]

    return constrain, update


def hf_processor(config: dict, prefixes):
    from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor

    by_prefix = {}
    for key, cands in config["prefix_dict"].items():
        by_prefix[tuple(int(x) for x in key.split("_")[1:])] = cands
    prompt_len = 3
    prompt = [7, 8, START]

    def allowed(batch_id: int, sent: torch.Tensor) -> list[int]:
        return by_prefix.get(tuple(sent[prompt_len:].tolist()), [END])

    proc = PrefixConstrainedLogitsProcessor(allowed, num_beams=1)
    input_ids = torch.tensor([prompt + list(p) for p in prefixes])
    return lambda logits: proc(input_ids, logits)


def xgrammar_step(items, prefixes, vocab: int):
    import xgrammar as xgr

    info = xgr.TokenizerInfo([f"<{i}>" for i in range(vocab)], xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=[END])
    ebnf = "root ::= " + " | ".join('"' + "".join(f"<{t}>" for t in item) + '"' for item in items)
    start = time.perf_counter()
    grammar = xgr.GrammarCompiler(info, max_threads=2).compile_grammar(ebnf)
    compile_s = time.perf_counter() - start
    matchers = []
    for prefix in prefixes:
        matcher = xgr.GrammarMatcher(grammar)
        for tok in prefix:
            assert matcher.accept_token(tok)
        matchers.append(matcher)
    batch = xgr.BatchGrammarMatcher(max_threads=2)
    bitmask = xgr.allocate_token_bitmask(len(prefixes), vocab)

    def constrain(logits: torch.Tensor) -> None:
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)

    return constrain, compile_s


# ---- the runs -------------------------------------------------------------------------------------


def greedy(constrain):
    def step(logits):
        out = constrain(logits)
        return (logits if out is None else out).argmax(-1)

    return step


def bench_vocab(vocab: int, config: dict, items, xgr_items, repeats: int, with_baselines: bool) -> dict:
    prefixes = batch_prefixes(items)
    tree = TreeDFA.from_prefix_dict(config, vocab_size=vocab, device="cpu")
    states = torch.tensor([tree.walk(p) for p in prefixes])
    logits = torch.randn(BATCH, vocab, generator=torch.Generator().manual_seed(0))
    bitmask = logitgate.allocate_token_bitmask(BATCH, vocab)

    def lg_dense(x):
        tree.fill_bitmask(states, bitmask)
        logitgate.apply_token_bitmask_inplace(x, bitmask)

    def lg_sparse_greedy(x):
        ids, valid = tree.candidates(states)
        picked = x.gather(1, ids).masked_fill_(~valid, float("-inf")).argmax(1, keepdim=True)
        return ids.gather(1, picked).squeeze(1)

    # The paths agree on the token they pick.
    reference = greedy(lg_dense)(logits.clone())
    assert torch.equal(lg_sparse_greedy(logits.clone()), reference)
    def t(name, fn, arg=logits):  # the row fields (median, min, max, spread) of fn(arg) under `name`
        return time_runs(lambda: fn(arg), repeats=repeats).fields(name)

    row = {
        "vocab": vocab,
        **t("logitgate_dense_constrain", lg_dense),
        **t("logitgate_dense_greedy", greedy(lg_dense)),
        **t("logitgate_sparse_greedy", lg_sparse_greedy),
        **t("logitgate_advance", lambda tokens: tree.advance(states, tokens), reference),
    }
    if with_baselines:
        rtp_constrain, rtp_update = rtp_style(config, prefixes, vocab)
        assert torch.equal(greedy(rtp_constrain)(logits.clone()), reference)
        hf = hf_processor(config, prefixes)
        assert torch.equal(greedy(hf)(logits.clone()), reference)
        row.update(
            **t("rtp_style_constrain", rtp_constrain),
            **t("rtp_style_greedy", greedy(rtp_constrain)),
            **t("rtp_style_update", rtp_update, reference),
            **t("hf_greedy", greedy(hf)),
        )
        if xgr_items:
            xgr_prefixes = batch_prefixes(xgr_items)
            xgr_constrain, compile_s = xgrammar_step(xgr_items, xgr_prefixes, vocab)
            row.update(**t("xgrammar_constrain", xgr_constrain), **t("xgrammar_greedy", greedy(xgr_constrain)),
                       xgrammar_compile_s=compile_s, xgrammar_items=len(xgr_items))
        row["dense_speedup_vs_rtp_style"] = row["rtp_style_constrain_ms"] / row["logitgate_dense_constrain_ms"]
        row["sparse_speedup_vs_rtp_style"] = row["rtp_style_greedy_ms"] / row["logitgate_sparse_greedy_ms"]
        row["sparse_speedup_vs_hf"] = row["hf_greedy_ms"] / row["logitgate_sparse_greedy_ms"]
        if xgr_items:
            row["dense_speedup_vs_xgrammar"] = row["xgrammar_constrain_ms"] / row["logitgate_dense_constrain_ms"]
    return row


def bench_compile(n_entries: int, repeats: int) -> dict:
    items = make_catalog(max(1, int(n_entries / 3.6)), seed=2)
    config = prefix_dict_config(items)
    text = json.dumps(config)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tree = TreeDFA.from_prefix_dict(config, vocab_size=128256, device="cpu", cache=False)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    TreeDFA.from_prefix_dict(text, vocab_size=128256, device="cpu", cache=False)
    text_s = time.perf_counter() - start
    start = time.perf_counter()
    json.loads(text)
    json_s = time.perf_counter() - start
    stats = tree.stats()
    return {
        "entries": len(config["prefix_dict"]),
        "json_mb": len(text) / 1e6,
        "from_dict_s": statistics.median(times),
        "from_json_text_s": text_s,
        "of_which_json_loads_s": json_s,
        "nodes": stats["nodes"],
        "device_bytes": stats["device_bytes"],
        "bytes_per_node": stats["bytes_per_node"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and vocabularies, a smaller compile test")
    parser.add_argument("--items", type=int, default=20000, help="catalog items (20k-100k in the issue)")
    parser.add_argument("--xgrammar-items", type=int, default=None, help="items in xgrammar's grammar (0 skips it)")
    parser.add_argument("--compile-entries", type=int, default=None, help="prefix-dict entries for the compile test")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch and numba threads for every method (1: robust on a shared, loaded host)")
    parser.add_argument("--out")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    set_thread_cap(args.threads)  # an explicit choice is not capped
    repeats = 9 if args.quick else args.repeats
    xgr_n = args.xgrammar_items if args.xgrammar_items is not None else (300 if args.quick else 2000)
    compile_entries = args.compile_entries or (100_000 if args.quick else 1_000_000)
    vocabs = [32000, 128256] if args.quick else [32000, 128256, 256000]
    items = make_catalog(args.items)
    config = prefix_dict_config(items)
    tree = TreeDFA.from_prefix_dict(config, vocab_size=max(vocabs), device="cpu")
    progress = Progress(len(vocabs) + 1, "tree")
    rows = []
    for v in vocabs:
        progress.step(f"B={BATCH} V={v}" + (" with baselines (RTP-style, HF, xgrammar)" if v == 128256 else ""))
        rows.append(bench_vocab(v, config, items, items[:xgr_n], repeats, with_baselines=(v == 128256)))
    sparse = [r["logitgate_sparse_greedy_ms"] for r in rows]
    main_row = next(r for r in rows if r["vocab"] == 128256)
    result = {
        "benchmark": "tree_decode_step",
        "backend": "cpu",
        "torch_threads": torch.get_num_threads(),
        "batch": BATCH,
        "catalog": {"items": len(items), "prefix_dict_entries": len(config["prefix_dict"]), **{
            k: tree.stats()[k] for k in ("nodes", "max_depth", "max_width", "dense_rows", "bytes_per_node")}},
        "xgrammar_note": f"xgrammar compiles a {xgr_n}-item alternation of the same catalog (compiling all "
        f"{len(items)} takes minutes on this machine); fewer items only makes its masks cheaper",
        "goals": "dense >= 3x rtp_style; sparse >= 30x rtp_style and flat over V; 1M-entry compile < 5 s",
        "summary": {
            "dense_speedup_vs_rtp_style": main_row["dense_speedup_vs_rtp_style"],
            "sparse_speedup_vs_rtp_style": main_row["sparse_speedup_vs_rtp_style"],
            "sparse_ms_by_vocab": dict(zip(map(str, vocabs), sparse)),
            "sparse_max_over_min": max(sparse) / min(sparse),
        },
        "rows": rows,
    }
    progress.step(f"compile a {compile_entries}-entry prefix dict")
    result["compile"] = bench_compile(compile_entries, 1 if args.quick else 3)
    emit(result, args.out)
    if args.plot:
        keys = ["rtp_style_greedy", "hf_greedy", "xgrammar_greedy", "logitgate_dense_greedy", "logitgate_sparse_greedy"]
        plot_bars([dict(row, label=f"B={BATCH} V={row['vocab']}") for row in rows], "label", keys,
                  f"one constrained greedy step over a {len(items)}-item tree (CPU)", args.plot)
    return result


if __name__ == "__main__":
    main()
