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

The "steps" section (issue 11) times a whole step = constraint + sampling (greedy, and T=1.0 with
top-p 0.9; the same Sampler everywhere) on three trees, B=64 rows at depths 0-2:
- random: 20k items of 3-8 tokens drawn uniformly from the vocabulary (the root allows ~18.5k);
- catalog: the narrow codebook catalog above (no node allows more than 256 tokens);
- strings: TreeDFA.from_strings over 100k strings (two or three word-like tokens of the real
  Llama-3 tokenizer, joined by spaces) tokenized with that tokenizer (add_special_tokens=False),
  with its compile time and memory per node;
methods: rtp_style (string keys, uint8 host mask, masked_fill, Sampler), logitgate_dense
(fill_bitmask + apply, Sampler) and logitgate_tree_step (sampling/tree_sampling.py:
sample_tree_step, the default crossover), interleaved, medians; "crossover" times sparse against
dense for rows allowing a growing fraction of the vocabulary. `--steps-only` skips the rest.

    python -m logitgate.bench.tree [--quick] [--steps-only] [--items N] [--xgrammar-items N] [--out FILE] [--plot FILE.png]
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
from logitgate.bench.harness import Progress, emit, plot_bars, time_runs
from logitgate.sampling import Sampler, SamplingMetadata, SamplingParams
from logitgate.sampling.tree_sampling import sample_tree_step
from logitgate.structured.tree.candidates import keep_only_allowed

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


# ---- whole steps: constraint + sampling (issue 11) ---------------------------------------------

STEP_MODES = {"greedy": dict(temperature=0.0), "top_p": dict(temperature=1.0, top_p=0.9)}


def random_items(n: int, vocab: int, seed: int = 3) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(3, vocab, rng.integers(3, 9)).tolist()) for _ in range(n)]


def word_strings(tokenizer, n: int, seed: int = 4) -> list[str]:
    """n distinct strings of two or three word-like tokens of the tokenizer's own vocabulary."""
    words = sorted({t.lstrip("\u0120") for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
                    if t and t.lstrip("\u0120").isalpha() and t.lstrip("\u0120").isascii() and len(t.lstrip("\u0120")) >= 3})
    rng = np.random.default_rng(seed)
    out: dict[str, None] = {}
    while len(out) < n:
        k = 2 + int(rng.integers(0, 2))
        out.setdefault(" ".join(words[i] for i in rng.integers(0, len(words), k)))
    return list(out)


def step_methods(tree: TreeDFA, config: dict, prefixes, vocab: int, mode: str):
    """name -> fn(logits) for one step of B rows at `prefixes` (token tuples from the tree's root)."""
    batch = len(prefixes)
    states = torch.tensor([tree.walk(p) for p in prefixes])
    metadata = SamplingMetadata.from_params([SamplingParams(**STEP_MODES[mode])] * batch)
    sampler = Sampler()
    bitmask = logitgate.allocate_token_bitmask(batch, vocab)
    rtp_constrain, _ = rtp_style(config, prefixes, vocab)

    def rtp(x):
        rtp_constrain(x)
        return sampler(x, metadata).sampled_token_ids

    def dense(x):
        tree.fill_bitmask(states, bitmask)
        logitgate.apply_token_bitmask_inplace(x, bitmask)
        return sampler(x, metadata).sampled_token_ids

    def tree_step(x):
        return sample_tree_step(sampler, x, tree, states, metadata).sampled_token_ids

    return {"rtp_style": rtp, "logitgate_dense": dense, "logitgate_tree_step": tree_step}, states


def interleaved_medians(methods: dict, logits: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median ms per method; the methods take turns, each on a fresh copy of the logits (the copy
    is not timed)."""
    work = logits.clone()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for name, fn in methods.items():  # warm-up (numba compile / cache load)
        work.copy_(logits)
        fn(work)
    for _ in range(repeats):
        for name, fn in methods.items():
            work.copy_(logits)
            start = time.perf_counter()
            fn(work)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def step_rows(tree_name: str, items, vocabs: list[int], repeats: int, with_rtp_at: int) -> list[dict]:
    config = prefix_dict_config(items)
    rng = np.random.default_rng(5)
    prefixes = [items[i][: d % 3] for d, i in enumerate(rng.integers(0, len(items), BATCH))]  # depths 0-2
    rows = []
    for vocab in vocabs:
        tree = TreeDFA.from_sequences(items, end_token_id=END, vocab_size=vocab, device="cpu")
        logits = torch.randn(BATCH, vocab, generator=torch.Generator().manual_seed(0))
        for mode in STEP_MODES:
            methods, states = step_methods(tree, config, prefixes, vocab, mode)
            if vocab != with_rtp_at:
                methods.pop("rtp_style")
            if mode == "greedy":  # the paths pick the same tokens
                picks = [fn(logits.clone()) for fn in methods.values()]
                assert all(torch.equal(p, picks[0]) for p in picks)
            ms = interleaved_medians(methods, logits, repeats)
            widths = tree.host.widths[states.numpy()]
            row = {"case": tree_name, "mode": mode, "vocab": vocab, "allowed_sum": int(widths.sum()),
                   "allowed_max": int(widths.max()), **{f"{k}_ms": v for k, v in ms.items()}}
            row["tree_step_speedup_vs_dense"] = ms["logitgate_dense"] / ms["logitgate_tree_step"]
            if "rtp_style" in ms:
                row["tree_step_speedup_vs_rtp_style"] = ms["rtp_style"] / ms["logitgate_tree_step"]
            rows.append(row)
        rows.append(processor_mask_row(tree_name, tree, states, logits, repeats))
    return rows


def processor_mask_row(tree_name: str, tree: TreeDFA, states: torch.Tensor, logits: torch.Tensor, repeats: int) -> dict:
    """A logits processor returns whole rows: bitmask fill + apply against keep_only_allowed (fill
    -inf, put the allowed logits back)."""
    bitmask = logitgate.allocate_token_bitmask(*logits.shape)

    def with_bitmask(x):
        tree.fill_bitmask(states, bitmask)
        logitgate.apply_token_bitmask_inplace(x, bitmask)

    methods = {"bitmask": with_bitmask, "keep_only_allowed": lambda x: keep_only_allowed(tree, x, states)}
    ms = interleaved_medians(methods, logits, repeats)
    return {"case": f"{tree_name}/processor_mask", "vocab": logits.shape[1], "bitmask_ms": ms["bitmask"],
            "keep_only_allowed_ms": ms["keep_only_allowed"], "keep_speedup_vs_bitmask": ms["bitmask"] / ms["keep_only_allowed"]}


def strings_tree(n: int, vocab: int) -> tuple[list[tuple[int, ...]], dict]:
    from logitgate.models.real_vocab import load_tokenizer

    tokenizer = load_tokenizer("llama3")
    strings = word_strings(tokenizer, n)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    start = time.perf_counter()
    sequences = [tuple(encode(text)) for text in strings]
    tokenize_s = time.perf_counter() - start
    start = time.perf_counter()
    TreeDFA.from_sequences(sequences, end_token_id=END, vocab_size=vocab, device="cpu", cache=False)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    tree = TreeDFA.from_strings(strings, encode, end_token_id=END, vocab_size=vocab, device="cpu", cache=False)
    from_strings_s = time.perf_counter() - start
    stats = tree.stats()
    info = {"strings": n, "examples": strings[:3], "tokens": sum(map(len, sequences)), "tokenize_s": tokenize_s,
            "compile_s": compile_s, "from_strings_s": from_strings_s, "nodes": stats["nodes"],
            "max_width": stats["max_width"], "device_bytes": stats["device_bytes"], "bytes_per_node": stats["bytes_per_node"]}
    return sequences, info


def crossover_rows(vocab: int, repeats: int) -> list[dict]:
    """All B rows at a root allowing a fraction f of the vocabulary: sparse (every row gathered)
    against dense (every row masked), per mode; the crossover is where the ratio falls below 1."""
    rows = []
    for fraction in (0.05, 0.1, 0.25, 0.5, 0.75):
        tokens = np.sort(np.random.default_rng(6).choice(np.arange(3, vocab), int(fraction * vocab), replace=False))
        tree = TreeDFA.from_sequences([[int(t)] for t in tokens], end_token_id=END, vocab_size=vocab, device="cpu", cache=False)
        states = tree.initial_states(BATCH)
        logits = torch.randn(BATCH, vocab, generator=torch.Generator().manual_seed(0))
        for mode in STEP_MODES:
            metadata = SamplingMetadata.from_params([SamplingParams(**STEP_MODES[mode])] * BATCH)
            sampler = Sampler()
            methods = {
                "sparse": lambda x: sample_tree_step(sampler, x, tree, states, metadata, sparse_max_fraction=1.0),
                "dense": lambda x: sample_tree_step(sampler, x, tree, states, metadata, sparse_max_fraction=0.0),
            }
            ms = interleaved_medians(methods, logits, repeats)
            rows.append({"case": "crossover", "allowed": fraction, "mode": mode, "vocab": vocab,
                         "sparse_ms": ms["sparse"], "dense_ms": ms["dense"], "sparse_speedup_vs_dense": ms["dense"] / ms["sparse"]})
    return rows


def bench_steps(items: int, strings: int, repeats: int, quick: bool) -> dict:
    main_v = 128256
    big = [main_v] if quick else [main_v, 256000]
    out_rows = step_rows("random", random_items(items, main_v), big, repeats, main_v)
    out_rows += step_rows("catalog", make_catalog(items), [32000] + big, repeats, main_v)
    sequences, info = strings_tree(strings, main_v)
    out_rows += step_rows("strings", sequences, big, repeats, main_v)
    cross = crossover_rows(main_v, max(5, repeats // 2))
    main = [r for r in out_rows if r["vocab"] == main_v and "tree_step_speedup_vs_rtp_style" in r]
    flat = {}
    for r in out_rows:
        if "logitgate_tree_step_ms" not in r:
            continue
        flat.setdefault(f"{r['case']}/{r['mode']}", {})[str(r["vocab"])] = r["logitgate_tree_step_ms"]
    return {
        "goals": "tree step >= 30x rtp_style on every tree, >= 5x dense on narrow trees, never slower than dense, flat in V",
        "min_speedup_vs_rtp_style": min(r["tree_step_speedup_vs_rtp_style"] for r in main),
        "min_speedup_vs_dense": min(r["tree_step_speedup_vs_dense"] for r in out_rows if "tree_step_speedup_vs_dense" in r),
        "tree_step_ms_by_vocab": flat,
        "strings_tree": info,
        "rows": out_rows,
        "crossover": cross,
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
    parser.add_argument("--steps-only", action="store_true", help="only the constraint + sampling steps (issue 11)")
    parser.add_argument("--strings", type=int, default=100_000, help="strings in the from_strings tree")
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
    steps = bench_steps(args.items, args.strings // (5 if args.quick else 1), repeats, args.quick)
    if args.steps_only:
        result = {"benchmark": "tree_decode_step", "backend": "cpu", "torch_threads": torch.get_num_threads(),
                  "batch": BATCH, "steps": {k: v for k, v in steps.items() if k != "rows"}, "rows": steps["rows"]}
        emit(result, args.out)
        return result
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
        "rows": rows + steps["rows"],
        "steps": {k: v for k, v in steps.items() if k != "rows"},
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
