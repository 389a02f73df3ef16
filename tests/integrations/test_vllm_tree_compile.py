"""The engine's compile of a large tree (issue 36, defect 3): parsed and checked in the admission
process, built here from its arrays, the same tree as a compile in this process, with the same
errors, without holding this process's GIL for the parse."""
from __future__ import annotations

import json
import pickle
import threading
import time

import numpy as np
import pytest

from logitgate.bench.tree_admission_stall import trie_text  # the engine tests' trees: 260 tokens, end 257
from logitgate.integrations.vllm.tree import compile as tree_compile
from logitgate.integrations.vllm.tree.admission_process import INLINE_MAX_BYTES
from logitgate.structured.tree import shape as tree_shape
from logitgate.structured.tree.dfa import TreeDFA
from logitgate.structured.tree.request import TreeRequest

V, END = 260, 257


def large_prefix_dict(keys: int = 6000) -> str:
    """A prefix dict above INLINE_MAX_BYTES with unreachable keys (quoted in the build's warning)."""
    prefix = {"40": [10, 11]}
    for i in range(keys):
        prefix[f"40_{10 + i % 2}_{20 + i % 200}_{i // 200}"] = [2]
        prefix[f"40_{10 + i % 2}_{20 + i % 200}"] = [i // 200]
    prefix["41_9"] = [2]  # another start token: never reached
    return json.dumps({"start_token_id": 40, "end_token_id": 2, "prefix_dict": prefix})


def _same_tree(a: TreeDFA, b: TreeDFA) -> None:
    for field in ("trans_code", "trans_dst", "allow_ptr", "allow_tok", "frozen", "depth"):
        assert np.array_equal(getattr(a.host, field), getattr(b.host, field)), field
    assert a.stats() == b.stats()


@pytest.mark.parametrize("kind", ["token_trie", "tree_decode"])
def test_a_large_tree_is_built_from_the_admission_process_arrays(monkeypatch, kind):
    text = trie_text(0.2) if kind == "token_trie" else large_prefix_dict()
    assert len(text) > INLINE_MAX_BYTES
    request = TreeRequest(kind, text, END if kind == "token_trie" else None)
    TreeDFA.cache_clear()
    inline = request.compile(V, eos_token_id=None)
    TreeDFA.cache_clear()
    monkeypatch.setattr(tree_shape, "_shape", lambda *args: pytest.fail("parsed in the engine's process"))
    built = tree_compile.compile_tree(request, V, None)
    assert built is not inline
    _same_tree(built, inline)


def test_a_bad_large_tree_fails_with_the_message_of_a_compile_here():
    for text in (trie_text(0.2, bad_last_token=True), trie_text(0.2)[:-1]):
        request = TreeRequest("token_trie", text, END)
        with pytest.raises(ValueError) as here:
            request.compile(V, eos_token_id=None)
        with pytest.raises(ValueError) as there:
            tree_compile.compile_tree(request, V, None)
        assert str(there.value) == str(here.value) and str(here.value).startswith("extra_args['token_trie']: ")


def test_a_large_tree_sent_again_is_not_parsed_again_while_it_lives(monkeypatch):
    request = TreeRequest("token_trie", trie_text(0.2, variant=7), END)
    first = tree_compile.compile_tree(request, V, None)
    monkeypatch.setattr(tree_compile, "parse_in_process", lambda job: pytest.fail("parsed again"))
    assert tree_compile.compile_tree(TreeRequest("token_trie", trie_text(0.2, variant=7), END), V, None) is first


def _longest_gap(work) -> float:
    """The longest wait of a thread that wakes every millisecond while `work` runs."""
    gaps, stop = [], threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        work()
    finally:
        stop.set()
        ticker.join()
    return max(gaps)


def test_a_large_compile_leaves_the_gil_to_other_threads():
    """A compile here holds the GIL for its parse (the engine core's steps wait); the engine's
    compile_tree does not (measured: 10 MB, 0.73 s against 0.02 s on 2 cores)."""
    tree_compile.compile_tree(TreeRequest("token_trie", trie_text(0.2, variant=1), END), V, None)  # process started
    for megabytes in (8, 16, 32):  # a tree large enough that its parse here holds the GIL for 0.15 s (host speed varies)
        TreeDFA.cache_clear()
        here = _longest_gap(lambda: TreeRequest("token_trie", trie_text(megabytes, variant=2), END).compile(
            V, eos_token_id=None))
        if here > 0.15:
            break
    assert here > 0.15, f"the compile here held the GIL only {here:.3f} s even for {megabytes} MB: too small a tree to tell"
    TreeDFA.cache_clear()
    text = trie_text(megabytes, variant=3)
    there = _longest_gap(lambda: tree_compile.compile_tree(TreeRequest("token_trie", text, END), V, None))
    assert there < min(0.2, here / 3), (here, there)


def test_joined_keys_read_as_the_keys_and_pickle_as_buffers():
    keys = ["40", "40_10", "40_ü_12", ""]
    joined = tree_shape.JoinedKeys(keys)
    assert len(joined) == 4 and list(joined) == keys and joined[-2] == "40_ü_12" and joined[1:3] == keys[1:3]
    with pytest.raises(IndexError):
        joined[4]
    assert list(pickle.loads(pickle.dumps(joined, pickle.HIGHEST_PROTOCOL))) == keys
