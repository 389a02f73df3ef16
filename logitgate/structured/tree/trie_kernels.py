"""numba kernels that build a token trie in time linear in its input (graph.build_trie loads
them on first use: vLLM's start-up must not load numba).

`insert_sequences` walks every sequence once through an open-addressing hash table of
(parent << 31 | token) -> node, numbering nodes as they first appear; `level_order` renumbers them
breadth first with siblings by token, the order graph.py documents (and that the old per-level
numpy build produced)."""
from __future__ import annotations

import numba
import numpy as np

_EMPTY = -1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the high bits of code * this


@numba.njit(cache=True, nogil=True)
def insert_sequences(flat, starts, lengths, bits, parent, token, depth, pos_node, seq_node):  # pragma: no cover - jitted
    """Nodes of the trie of flat[starts[i] : starts[i] + lengths[i]]: node 0 is the root; parent,
    token, depth (preallocated, at least 1 + sum(lengths) long) are filled for nodes 1..n-1;
    pos_node[k] is the node after the k-th token of the walk (sequences in order), seq_node[i]
    the node sequence i ends at. Returns n. `bits`: log2 of the hash table size (> 2 x tokens)."""
    size = 1 << bits
    mask = size - 1
    shift = np.uint64(64 - bits)
    keys = np.full(size, _EMPTY, np.int64)
    values = np.empty(size, np.int64)
    parent[0] = -1
    token[0] = -1
    depth[0] = 0
    count = 1
    k = 0
    for i in range(starts.shape[0]):
        node = 0
        base = starts[i]
        for p in range(lengths[i]):
            tok = flat[base + p]
            code = (node << 31) | tok
            h = np.int64((np.uint64(code) * _GOLDEN) >> shift)
            while True:
                stored = keys[h]
                if stored == code:
                    node = values[h]
                    break
                if stored == _EMPTY:
                    keys[h] = code
                    values[h] = count
                    parent[count] = node
                    token[count] = tok
                    depth[count] = p + 1
                    node = count
                    count += 1
                    break
                h = (h + 1) & mask
            pos_node[k] = node
            k += 1
        seq_node[i] = node
    return count


@numba.njit(cache=True, nogil=True)
def level_order(children, child_ptr):  # pragma: no cover - jitted
    """order[j] = the old id of the node numbered j breadth first, where node v's children are
    children[child_ptr[v] : child_ptr[v + 1]], sorted by token."""
    n = child_ptr.shape[0] - 1
    order = np.empty(n, np.int64)
    order[0] = 0
    tail = 1
    for head in range(n):
        v = order[head]
        for c in range(child_ptr[v], child_ptr[v + 1]):
            order[tail] = children[c]
            tail += 1
    return order
