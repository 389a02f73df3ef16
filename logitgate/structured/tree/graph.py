"""Building a tree's integer form with numpy and numba (no per-key or per-level Python work):

- `build_trie` turns flattened token sequences into nodes (parent, token, depth), in level order
  with siblings sorted by token, so the (parent, token) edge list comes out already sorted; its
  cost is linear in the tokens (a numba hash-table walk), whatever the depth;
- `prefix_dict_graph` / `sequences_graph` say which nodes exist, what each allows and which are
  frozen (RTP-LLM's "after the end token nothing changes");
- `compile_graph` lays that out as CSR arrays plus the two special states, error and finished.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...backends.formats import num_bitmask_words
from .loaders import PrefixDictSpec, SequenceSpec, quote_key

CODE_SHIFT = 31  # (node, token) -> node << 31 | token; token ids are < 2**31
TOKEN_MASK = (1 << CODE_SHIFT) - 1
NO_EDGE = np.iinfo(np.int64).max  # sentinel after the last edge code, so searches never run off the end


@dataclass
class TreeGraph:
    """Nodes 0..n-1 (0 = root); node v > 0 hangs under parent[v] by token[v]. allow_* list the
    (node, token) pairs each node allows, in any order, possibly repeated."""

    parent: np.ndarray
    token: np.ndarray
    depth: np.ndarray
    allow_node: np.ndarray
    allow_tok: np.ndarray
    frozen: np.ndarray
    info: dict = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        return len(self.parent)


@dataclass
class CompiledTree:
    """Host (numpy) arrays of a compiled tree; states are nodes, then ERROR, then FINISHED."""

    num_nodes: int
    end_token_id: int
    trans_code: np.ndarray  # sorted int64 (src << 31 | token), NO_EDGE appended
    trans_dst: np.ndarray  # int64 target of each edge (a dummy 0 under the sentinel)
    allow_ptr: np.ndarray  # int64 (num_states + 1,) CSR over allow_tok
    allow_tok: np.ndarray  # int64 sorted token ids per state
    frozen: np.ndarray  # bool (num_states,): the state never changes (finished)
    depth: np.ndarray  # int64 (num_nodes,)
    vocab_words: int  # bitmask words the dense rows cover
    dense_nodes: np.ndarray  # states that keep a precomputed bitmask row, widest first
    info: dict

    @property
    def error_state(self) -> int:
        return self.num_nodes

    @property
    def finished_state(self) -> int:
        return self.num_nodes + 1

    @property
    def num_states(self) -> int:
        return self.num_nodes + 2

    @property
    def widths(self) -> np.ndarray:
        return np.diff(self.allow_ptr)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n), vectorised."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    ends = np.cumsum(lengths)
    base = np.repeat(starts - (ends - lengths), lengths)
    return base + np.arange(total, dtype=np.int64)


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique for int arrays by sort + compare (numpy's hash-based unique is far slower here)."""
    out = np.sort(values)
    keep = np.empty(len(out), bool)
    keep[:1] = True
    np.not_equal(out[1:], out[:-1], out=keep[1:])
    return out[keep]


def build_trie(flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, ...]:
    """Trie of the sequences flat[starts[i] : starts[i] + lengths[i]], in time linear in their
    tokens (numba: one hash-table walk, then a breadth-first renumbering).

    Returns (parent, token, depth, seq_node, walk_node): node arrays (root 0 has parent -1, token
    -1), the node each sequence ends at, and the node after each token of the sequences in order
    (sequence i's tokens at walk positions sum(lengths[:i]) ...). Nodes are numbered level by level
    and, inside a level, by (parent, token) — so parent << 31 | token increases with the node id.
    """
    from .trie_kernels import insert_sequences, level_order

    flat = np.ascontiguousarray(flat, np.int64)
    starts = np.ascontiguousarray(starts, np.int64)
    lengths = np.ascontiguousarray(lengths, np.int64)
    total = int(lengths.sum())
    parent, token, depth = (np.empty(total + 1, np.int64) for _ in range(3))
    walk_node = np.empty(total, np.int64)
    seq_node = np.empty(len(starts), np.int64)
    bits = max(4, (total + total // 2).bit_length())  # a table at most 2/3 full: short probes
    n = insert_sequences(flat, starts, lengths, bits, parent, token, depth, walk_node, seq_node)
    parent, token, depth = parent[:n], token[:n], depth[:n]
    # Breadth first, children by token: the children of node v sorted by (v, token) in CSR form.
    children = np.argsort((parent[1:] << CODE_SHIFT) | token[1:]) + 1
    child_ptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(parent[1:], minlength=n), out=child_ptr[1:])
    order = level_order(children, child_ptr)
    new_id = np.empty(n, np.int64)
    new_id[order] = np.arange(n)
    new_parent = parent[order]
    new_parent[1:] = new_id[new_parent[1:]]
    return new_parent, token[order], depth[order], new_id[seq_node], new_id[walk_node]


def sequences_graph(spec: SequenceSpec, end_token_id: int) -> TreeGraph:
    """Token trie: a node allows its children and, where a sequence ends, the end token."""
    starts = spec.offsets[:-1]
    parent, token, depth, seq_node, _ = build_trie(spec.token_ids, starts, np.diff(spec.offsets))
    terminal = sorted_unique(seq_node)
    allow_node = np.concatenate([parent[1:], terminal])
    allow_tok = np.concatenate([token[1:], np.full(len(terminal), end_token_id, np.int64)])
    frozen = np.zeros(len(parent), bool)
    info = {"sequences": len(starts), "terminal_nodes": len(terminal)}
    return TreeGraph(parent, token, depth, allow_node, allow_tok, frozen, info)


def prefix_dict_graph(spec: PrefixDictSpec, max_examples: int = 5) -> TreeGraph:
    """RTP-LLM semantics as a graph. The state is the key reached so far; token t from key k goes to
    key k+sep+t when that key exists in the dict (whatever k's candidates say), to "finished" when t
    is the end token, else to the error state. A key allows its candidate list, or only the end
    token when the list is empty or the key is absent (the root, when the start key is missing).
    A key ending in the end token is a frozen state that allows its own candidates.
    Keys that cannot be reached (other start token, a missing intermediate key, a token after the
    end token) are dropped and counted; info["unreachable_examples"] quotes the first
    `max_examples` of them, each cut by quote_key (logs and the CLI print them)."""
    end = spec.end_token_id
    n_keys = len(spec.keys)
    lengths = np.diff(spec.part_offsets)
    first = spec.part_ids[spec.part_offsets[:-1]] if n_keys else np.zeros(0, np.int64)
    usable = first == spec.start_token_id
    # A key that walks past the end token can never be reached: the DFA stops at the end token.
    key_of_part = np.repeat(np.arange(n_keys), lengths)
    pos = np.arange(len(spec.part_ids)) - spec.part_offsets[key_of_part]
    past_end = (spec.part_ids == end) & (pos >= 1) & (pos < lengths[key_of_part] - 1)
    usable[key_of_part[past_end]] = False
    keys_idx = np.flatnonzero(usable)
    key_lengths = lengths[keys_idx] - 1
    parent, token, depth, seq_node, walk_node = build_trie(spec.part_ids, spec.part_offsets[keys_idx] + 1, key_lengths)
    n = len(parent)
    is_key = np.zeros(n, bool)
    is_key[seq_node] = True
    frozen = np.zeros(n, bool)
    frozen[1:] = token[1:] == end
    # Reachable: every key along the path exists (children of a frozen node cannot exist: their
    # keys walk past the end token and were dropped above). Along each key's walk, count the
    # nodes so far that are not keys: a node is reachable where that count is still 0.
    missing = np.zeros(len(walk_node) + 1, np.int64)
    np.cumsum(~is_key[walk_node], out=missing[1:])
    walk_start = np.cumsum(key_lengths) - key_lengths
    reachable = np.zeros(n, bool)
    reachable[0] = True
    reachable[walk_node] = missing[1:] == np.repeat(missing[walk_start], key_lengths)
    new_id = np.cumsum(reachable) - 1
    keep = np.flatnonzero(reachable)
    parent = np.where(parent[keep] >= 0, new_id[np.maximum(parent[keep], 0)], -1)
    token, depth, frozen = token[keep], depth[keep], frozen[keep]
    # Candidates of every reachable key; a node without candidates allows only the end token.
    key_ok = reachable[seq_node]
    live_keys = keys_idx[key_ok]
    key_node = new_id[seq_node[key_ok]]
    clens = np.diff(spec.cand_offsets)[live_keys]
    allow_node = np.repeat(key_node, clens)
    allow_tok = spec.cand_ids[_ranges(spec.cand_offsets[live_keys], clens)]
    has_cands = np.zeros(len(keep), bool)
    has_cands[allow_node] = True
    fallback = np.flatnonzero(~has_cands)
    allow_node = np.concatenate([allow_node, fallback])
    allow_tok = np.concatenate([allow_tok, np.full(len(fallback), end, np.int64)])
    unreachable = np.ones(n_keys, bool)
    unreachable[live_keys] = False
    bad = np.flatnonzero(unreachable)
    info = {
        "keys": n_keys,
        "unreachable_keys": len(bad),
        "unreachable_examples": [quote_key(spec.keys[i]) for i in bad[:max_examples]],
        "start_key_present": bool(is_key[0]),
    }
    return TreeGraph(parent, token, depth, allow_node, allow_tok, frozen, info)


def compile_graph(
    graph: TreeGraph,
    end_token_id: int,
    vocab_size: int | None,
    dense_min_width: int,
    dense_budget_bytes: int,
) -> CompiledTree:
    """CSR layout plus ERROR (allows only the end token; the end token finishes it, any other token
    keeps it) and FINISHED (allows only the end token, never changes). The widest nodes of at least
    `dense_min_width` allowed tokens keep a precomputed bitmask row, within `dense_budget_bytes`."""
    n = graph.num_nodes
    error, finished = n, n + 1
    codes = (graph.parent[1:] << CODE_SHIFT) | graph.token[1:]
    dst = np.arange(1, n, dtype=np.int64)
    if codes.size > 1 and not np.all(codes[1:] > codes[:-1]):  # build_trie order makes this rare
        order = np.argsort(codes, kind="stable")
        codes, dst = codes[order], dst[order]
    trans_code = np.append(codes, NO_EDGE)
    trans_dst = np.append(dst, 0)
    allow_codes = np.concatenate(
        [
            (graph.allow_node << CODE_SHIFT) | graph.allow_tok,
            np.array([(error << CODE_SHIFT) | end_token_id, (finished << CODE_SHIFT) | end_token_id], np.int64),
        ]
    )
    allow_codes = sorted_unique(allow_codes)  # sorts per state and token, drops repeated candidates
    allow_state = allow_codes >> CODE_SHIFT
    allow_tok = allow_codes & TOKEN_MASK
    allow_ptr = np.zeros(n + 3, np.int64)
    np.cumsum(np.bincount(allow_state, minlength=n + 2), out=allow_ptr[1:])
    frozen = np.concatenate([graph.frozen, [False, True]])
    max_token = max(int(allow_tok.max()), int(graph.token.max()), end_token_id)
    vocab_words = num_bitmask_words(vocab_size if vocab_size is not None else max_token + 1)
    widths = np.diff(allow_ptr)
    wide = np.flatnonzero(widths >= max(dense_min_width, 1))
    max_rows = dense_budget_bytes // (vocab_words * 4)
    dense_nodes = wide[np.argsort(-widths[wide], kind="stable")][:max_rows]
    return CompiledTree(
        num_nodes=n,
        end_token_id=end_token_id,
        trans_code=trans_code,
        trans_dst=trans_dst,
        allow_ptr=allow_ptr,
        allow_tok=allow_tok,
        frozen=frozen,
        depth=graph.depth,
        vocab_words=vocab_words,
        dense_nodes=dense_nodes,
        info=dict(graph.info, max_token_id=max_token),
    )
