"""graph.build_trie (numba, linear) against a plain-Python trie: the same nodes, numbered the same
way (level by level, siblings by token), the same end node per sequence and node per walk position;
and compile times that stay linear on the inputs of issue 22.2 (deep chains, a long unreachable key)."""
import json
import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from logitgate import TreeDFA
from logitgate.structured.tree.graph import build_trie
from logitgate.structured.tree.limits import TreeLimits

NO_LIMITS = TreeLimits(1 << 40, 1 << 40, 1 << 40)


def reference_trie(sequences):
    """A dict-of-children trie, numbered breadth first with children sorted by token."""
    children: list[dict[int, int]] = [{}]
    walks = []
    for seq in sequences:
        node, walk = 0, []
        for tok in seq:
            if tok not in children[node]:
                children[node][tok] = len(children)
                children.append({})
            node = children[node][tok]
            walk.append(node)
        walks.append(walk)
    order, head = [0], 0
    while head < len(order):
        order.extend(children[order[head]][t] for t in sorted(children[order[head]]))
        head += 1
    new = {old: i for i, old in enumerate(order)}
    parent, token, depth = [-1] * len(order), [-1] * len(order), [0] * len(order)
    for old in order:
        for tok, child in children[old].items():
            parent[new[child]], token[new[child]], depth[new[child]] = new[old], tok, depth[new[old]] + 1
    seq_node = [new[w[-1]] if w else 0 for w in walks]
    walk_node = [new[n] for w in walks for n in w]
    return parent, token, depth, seq_node, walk_node


sequences_st = st.lists(st.lists(st.integers(0, 6), max_size=12), min_size=1, max_size=25)


@settings(max_examples=200, deadline=None)
@given(sequences=sequences_st, big_tokens=st.booleans())
def test_build_trie_matches_the_reference(sequences, big_tokens):
    if big_tokens:  # ids near the int32 top (the edge code packs them into 31 bits)
        sequences = [[2**31 - 1 - t for t in seq] for seq in sequences]
    flat = np.array([t for s in sequences for t in s], np.int64)
    lengths = np.array([len(s) for s in sequences], np.int64)
    # Sequences need not be contiguous: put a gap of junk between them.
    padded = np.full(len(flat) + 3 * len(sequences), 999, np.int64)
    starts = np.cumsum(np.concatenate([[0], lengths[:-1] + 3]))
    for s, seq in zip(starts, sequences):
        padded[s : s + len(seq)] = seq
    got = build_trie(padded, starts, lengths)
    want = reference_trie(sequences)
    for g, w in zip(got, want):
        assert g.tolist() == list(w)


def chain_payload(n: int) -> str:
    tokens = (1000 + np.arange(n) % 9000).tolist()
    return json.dumps({"modelId": "m", "descriptors": [{"path": "p", "leaves": [{"name": "x", "tokens": tokens}]}]})


def test_deep_chain_compiles_in_linear_time():
    # Issue 22.2: a 100k-token leaf took 4.4 s, a 500k-token one 23.7 s (a numpy round per level).
    TreeDFA.from_token_trie(chain_payload(10), end_token_id=2, cache=False, limits=NO_LIMITS)  # numba warm-up
    text = chain_payload(300_000)
    start = time.perf_counter()
    tree = TreeDFA.from_token_trie(text, end_token_id=2, vocab_size=128256, device="cpu", cache=False, limits=NO_LIMITS)
    elapsed = time.perf_counter() - start
    assert tree.stats()["max_depth"] == 300_000 and tree.forced_tokens(0, 3) == [1000, 1001, 1002]
    assert elapsed < 3.0, f"{elapsed:.1f} s for a 300k-token chain"


def test_long_unreachable_key_compiles_in_linear_time():
    # Issue 22.2: one unreachable 300k-part key took 10.6 s for a 1-node tree.
    key = "225_" + "_".join(["1"] * 300_000)
    text = json.dumps({"start_token_id": 225, "end_token_id": 2, "prefix_dict": {"225": [1], key: [3]}})
    start = time.perf_counter()
    tree = TreeDFA.from_prefix_dict(text, vocab_size=128256, device="cpu", cache=False, limits=NO_LIMITS)
    elapsed = time.perf_counter() - start
    stats = tree.stats()
    assert stats["nodes"] == 1 and stats["unreachable_keys"] == 1 and tree.allowed(0) == [1]
    assert elapsed < 3.0, f"{elapsed:.1f} s for a 1-node tree"


@settings(max_examples=100, deadline=None)
@given(sequences=st.lists(st.lists(st.integers(3, 9), min_size=1, max_size=8), min_size=1, max_size=20),
       drop=st.lists(st.integers(0, 200), max_size=5))
def test_the_counted_size_bounds_the_compiled_tree(sequences, drop):
    """What the node and depth limits count (loaders.TreeSize, before the trie is built) is never
    less than the compiled tree's nodes and depth: a tree within the limits compiles within them.
    Sequences: exactly, when no two share a first token; a prefix dict of every prefix: exactly,
    and still a bound with keys dropped (the keys past a dropped one become unreachable)."""
    from logitgate.models.demo import build_prefix_dict
    from logitgate.structured.tree.loaders import parse_prefix_dict, prefix_dict_size, sequences_size

    size = sequences_size(np.array([len(s) for s in sequences]))
    stats = TreeDFA.from_sequences(sequences, end_token_id=2, cache=False, limits=NO_LIMITS).stats()
    assert stats["nodes"] <= size.nodes and stats["max_depth"] == size.depth
    if len({s[0] for s in sequences}) == len(sequences):
        assert stats["nodes"] == size.nodes
    config = build_prefix_dict(sequences, start_token_id=1, end_token_id=2)
    keys = list(config["prefix_dict"])
    size = prefix_dict_size(parse_prefix_dict(config))
    stats = TreeDFA.from_prefix_dict(config, cache=False, limits=NO_LIMITS).stats()
    assert (stats["nodes"], stats["max_depth"]) == size
    for i in drop:
        config["prefix_dict"].pop(keys[i % len(keys)], None)
    size = prefix_dict_size(parse_prefix_dict(config))
    stats = TreeDFA.from_prefix_dict(config, cache=False, limits=NO_LIMITS).stats()
    assert stats["nodes"] <= size.nodes and stats["max_depth"] <= size.depth
