"""Issue 22, library side: operator limits on a tree's size (TreeTooLarge before the work they
protect), the compile cache bounded in bytes, batch rows validated before the candidate kernels
index logits with them, and log lines that quote a hostile key only in part."""
import json
import logging

import numpy as np
import pytest
import torch

from logitgate import TreeDFA
from logitgate.sampling import Sampler, SamplingMetadata, SamplingParams
from logitgate.sampling.tree_sampling import greedy_plan, sample_plan, tree_layouts
from logitgate.structured.tree import dfa as tree_module
from logitgate.structured.tree.candidates import plan_tree_step
from logitgate.structured.tree.limits import (
    DEFAULT_CACHE_BYTES,
    ENV_CACHE_BYTES,
    ENV_MAX_BYTES,
    ENV_MAX_DEPTH,
    ENV_MAX_NODES,
    TreeLimits,
    TreeTooLarge,
    check_environment,
)

PREFIX_DICT = {"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [5, 6], "1_5": [7], "1_5_7": [2]}}


# ---- limits (22.2) ------------------------------------------------------------------------------


def test_bytes_limit_refuses_text_before_parsing(monkeypatch):
    monkeypatch.setenv(ENV_MAX_BYTES, "100")
    text = "{" + " " * 200  # not even JSON: the size is checked first
    with pytest.raises(TreeTooLarge, match=rf"its size is 201 bytes, over the limit of 100 bytes .*{ENV_MAX_BYTES}") as info:
        TreeDFA.from_prefix_dict(text, cache=False)
    assert (info.value.limit, info.value.value, info.value.maximum, info.value.env_var) == ("bytes", 201, 100, ENV_MAX_BYTES)
    assert isinstance(info.value, ValueError)
    with pytest.raises(TreeTooLarge, match="token trie payload is too large"):
        TreeDFA.from_token_trie(text.encode(), end_token_id=0, cache=False)
    monkeypatch.setenv(ENV_MAX_BYTES, "1000")
    assert TreeDFA.from_prefix_dict(json.dumps(PREFIX_DICT), cache=False).walk([5, 7]) > 0


def test_bytes_limit_reads_a_file_no_further(tmp_path, monkeypatch):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(PREFIX_DICT) + " " * 5000)
    with pytest.raises(TreeTooLarge, match=r"prefix dict config file .* is too large: its size is 5\d\d\d bytes, over the limit of 1024"):
        TreeDFA.from_prefix_dict(path, cache=False, limits=TreeLimits(max_bytes=1024))
    monkeypatch.setenv(ENV_MAX_BYTES, "1024")
    with pytest.raises(TreeTooLarge):
        TreeDFA.from_prefix_dict(str(path), cache=False)
    # /dev/zero never ends: the limit stops the read.
    with pytest.raises(TreeTooLarge, match="its size is 1025 bytes"):
        TreeDFA.from_prefix_dict("/dev/zero", cache=False)


def test_depth_limit_refuses_before_the_trie_is_built(monkeypatch):
    def no_trie(*args, **kwargs):
        raise AssertionError("the trie was built")

    monkeypatch.setattr("logitgate.structured.tree.graph.build_trie", no_trie)
    monkeypatch.setenv(ENV_MAX_DEPTH, "3")
    with pytest.raises(TreeTooLarge, match=rf"sequences is too large: its depth is 4 tokens, over the limit of 3 tokens .*{ENV_MAX_DEPTH}"):
        TreeDFA.from_sequences([[5], [5, 6, 7, 8]], end_token_id=0, cache=False)
    with pytest.raises(TreeTooLarge, match="token trie is too large: its depth is 4 tokens"):
        payload = {"descriptors": [{"leaves": [{"tokens": [1, 2, 3, 4]}]}]}
        TreeDFA.from_token_trie(payload, end_token_id=0, cache=False)
    deep = dict(PREFIX_DICT, prefix_dict={"1_5_6_7_8": [3]})  # 4 parts after the start token
    with pytest.raises(TreeTooLarge, match="prefix dict is too large: its depth is 4 tokens"):
        TreeDFA.from_prefix_dict(deep, cache=False)


def test_nodes_limit_refuses_before_the_compiled_arrays(monkeypatch):
    def no_compile(*args, **kwargs):
        raise AssertionError("the tree was compiled")

    monkeypatch.setattr(tree_module, "compile_graph", no_compile)
    limits = TreeLimits(max_nodes=5)  # the root and the 5 tokens written: 6 (5 once the shared 5 merges)
    with pytest.raises(TreeTooLarge, match=rf"its node count is 6 nodes, over the limit of 5 nodes .*{ENV_MAX_NODES}"):
        TreeDFA.from_sequences([[5, 6], [5, 7], [8]], end_token_id=0, cache=False, limits=limits)
    with pytest.raises(TreeTooLarge, match="its node count is 3 nodes, over the limit of 2 nodes"):
        TreeDFA.from_prefix_dict(PREFIX_DICT, cache=False, limits=TreeLimits(max_nodes=2))


def test_limits_from_the_environment_are_checked(monkeypatch):
    assert TreeLimits.from_env({}) == TreeLimits()
    assert TreeLimits.from_env({ENV_MAX_NODES: "1_000"}).max_nodes == 1000
    assert check_environment({})[1] == DEFAULT_CACHE_BYTES
    for name, value in [(ENV_MAX_BYTES, "lots"), (ENV_MAX_DEPTH, "0"), (ENV_CACHE_BYTES, "-1")]:
        with pytest.raises(ValueError, match=name):
            check_environment({name: value})
    monkeypatch.setenv(ENV_MAX_NODES, "many")
    with pytest.raises(ValueError, match=f"{ENV_MAX_NODES}='many' is not an integer"):
        TreeDFA.from_sequences([[5]], end_token_id=0, cache=False)
    with pytest.raises(ValueError, match="limits must be a TreeLimits"):
        TreeDFA.from_sequences([[5]], end_token_id=0, cache=False, limits={"max_nodes": 3})


# ---- compile cache in bytes (22.3) ----------------------------------------------------------------


def wide_tree(seed: int, cache: bool = True) -> TreeDFA:
    # A root allowing 300 tokens keeps a dense bitmask row of V/32 words (V = 128256: 16 KB).
    rng = np.random.default_rng(seed)
    tokens = rng.choice(np.arange(3, 128256), 300, replace=False)
    return TreeDFA.from_sequences([[int(t)] for t in tokens], end_token_id=2, vocab_size=128256, device="cpu", cache=cache)


def test_tree_nbytes_counts_every_buffer_once():
    tree = wide_tree(0, cache=False)
    stats = tree.stats()
    assert stats["dense_rows"] == 1
    host = tree.host
    host_bytes = sum(a.nbytes for a in (host.trans_code, host.trans_dst, host.allow_ptr, host.allow_tok,
                                        host.frozen, host.depth, host.dense_nodes))
    # On CPU the int64 tensors share the host arrays; the int32 copies and the dense rows do not.
    assert stats["dense_bytes"] <= tree.nbytes <= host_bytes + stats["device_bytes"]
    assert tree.nbytes >= host_bytes + stats["dense_bytes"]


def test_compile_cache_stays_within_its_byte_bound():
    bound = 5 * wide_tree(0, cache=False).nbytes // 2  # room for two such trees
    TreeDFA.set_cache_size(32, max_bytes=bound)
    try:
        for seed in range(12):
            wide_tree(seed)
            info = TreeDFA.cache_info()
            assert info["bytes"] <= bound and info["max_bytes"] == bound
        assert info["size"] == 2 and info["misses"] == 12
        assert wide_tree(11) is wide_tree(11) and TreeDFA.cache_info()["hits"] == 2  # the newest stay
        TreeDFA.set_cache_size(32, max_bytes=100)  # smaller than any tree: built, never kept
        wide_tree(1)
        assert TreeDFA.cache_info()["size"] == 0 and TreeDFA.cache_info()["bytes"] == 0
    finally:
        TreeDFA.set_cache_size()


def test_cache_byte_bound_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_CACHE_BYTES, "12345")
    TreeDFA.set_cache_size()
    try:
        assert TreeDFA.cache_info()["max_bytes"] == 12345
        monkeypatch.delenv(ENV_CACHE_BYTES)
        TreeDFA.set_cache_size()
        assert TreeDFA.cache_info()["max_bytes"] == DEFAULT_CACHE_BYTES
    finally:
        TreeDFA.set_cache_size()


# ---- batch rows of a plan (22.8) ------------------------------------------------------------------

TREE = TreeDFA.from_sequences([[5, 6], [5, 7], [9]], end_token_id=0, vocab_size=64, device="cpu")


def greedy_meta(batch: int) -> SamplingMetadata:
    return SamplingMetadata(temperature=None, all_greedy=True, all_random=False)


def random_meta(batch: int) -> SamplingMetadata:
    return SamplingMetadata.from_params([SamplingParams(temperature=1.0)] * batch)


@pytest.mark.parametrize(
    "rows, message",
    [
        ([1, 1], r"rows\[1\] = 1 repeats rows\[0\]"),
        ([0, 10**12], r"rows\[1\] = 1000000000000 is outside \[0, 2147483647\]"),
        ([0, -1], r"rows\[1\] = -1 is outside"),
        ([0, True], r"rows\[1\] = True is not an integer row index"),
        ([0, 1.0], r"rows\[1\] = 1.0 is not an integer row index"),
        (torch.tensor([0.0, 1.0]), r"rows\[0\] = 0.0 is not an integer"),
        ([0], r"rows has 1 entries for 2 states"),
    ],
)
def test_plan_rows_are_validated(rows, message):
    states = TREE.initial_states(2)
    with pytest.raises(ValueError, match=message):
        plan_tree_step(TREE, states, 64, rows=rows)


def test_plan_rows_outside_the_logits_batch_are_refused_when_sampling():
    states = TREE.initial_states(2)
    plan = plan_tree_step(TREE, states, 64, rows=[0, 5])
    logits = torch.randn(2, 64)
    for run in (
        lambda: sample_plan(Sampler(), plan, logits, greedy_meta(2)),
        lambda: sample_plan(Sampler(), plan, logits, random_meta(2)),
        lambda: greedy_plan(Sampler(), plan, logits),
        lambda: tree_layouts(plan, logits),
    ):
        with pytest.raises(ValueError, match=r"the plan covers batch rows up to 5 but logits have shape \(2, 64\)"):
            run()
    # A permutation of the batch is fine, and every row gets its own token.
    plan = plan_tree_step(TREE, states, 64, rows=np.array([1, 0]))
    for meta in (greedy_meta(2), random_meta(2)):
        tokens = sample_plan(Sampler(), plan, logits, meta).sampled_token_ids.squeeze(1).tolist()
        assert all(t in (5, 9) for t in tokens)


def test_keep_only_allowed_rows_are_checked_on_cpu():
    from logitgate.structured.tree.candidates import keep_only_allowed

    states = TREE.initial_states(2)
    with pytest.raises(ValueError, match="rows holds 7, outside the 2 rows of logits"):
        keep_only_allowed(TREE, torch.zeros(2, 64), states, torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="rows must be a 1-D int32/int64 tensor"):
        keep_only_allowed(TREE, torch.zeros(2, 64), states, [0, 1])


# ---- quoted keys (22.11) --------------------------------------------------------------------------


def test_unreachable_key_warning_quotes_keys_in_part(caplog):
    long_key = "1_9_" + "_".join(["4"] * 20000)  # "1_9" is not a key: unreachable
    config = dict(PREFIX_DICT, prefix_dict={**PREFIX_DICT["prefix_dict"], long_key: [3], **{f"1_8_{i}": [3] for i in range(9)}})
    with caplog.at_level(logging.WARNING, logger="logitgate.structured.tree"):
        tree = TreeDFA.from_prefix_dict(config, cache=False)
    (record,) = [r for r in caplog.records if "can never be reached" in r.getMessage()]
    line = record.getMessage()
    assert len(line) < 1000 and f"({len(long_key)} characters)" in line and "10 of 13 keys" in line
    assert tree.stats()["unreachable_examples"][0] == long_key[:80] + f"... ({len(long_key)} characters)"


def test_error_messages_quote_keys_and_names_in_part():
    long_key = "1_" + "_".join(["4"] * 20000) + "_x"
    with pytest.raises(ValueError) as info:
        TreeDFA.from_prefix_dict(dict(PREFIX_DICT, prefix_dict={long_key: [3]}), cache=False)
    assert len(str(info.value)) < 400 and f"({len(long_key)} characters)" in str(info.value)
    payload = {"descriptors": [{"leaves": [{"name": "n" * 50000, "tokens": [-1]}]}]}
    with pytest.raises(ValueError) as info:
        TreeDFA.from_token_trie(payload, end_token_id=0, cache=False)
    assert len(str(info.value)) < 400 and "(50000 characters)" in str(info.value)
    many = {"descriptors": [{"path": "p" * 1000 + str(i), "leaves": [{"tokens": [1]}]} for i in range(100)]}
    with pytest.raises(ValueError, match=r"100 descriptors .*\(95 more\)\]; choose one") as info:
        TreeDFA.from_token_trie(many, end_token_id=0, cache=False)
    assert len(str(info.value)) < 1000


# ---- loaders: malformed payloads (22.9 and the search for others) ----------------------------------


@pytest.mark.parametrize(
    "payload, message",
    [
        ({"descriptors": [{"path": ["a"], "leaves": [{"tokens": [1]}]}]}, r"descriptor 0 key 'path' must be a string, got list"),
        ({"descriptors": [{"path": "a", "leaves": []}, {"path": {"x": 1}, "leaves": []}]}, r"descriptor 1 key 'path' must be a string, got dict"),
        ({"modelId": 7, "descriptors": [{"leaves": [{"tokens": [1]}]}]}, r"key 'modelId' must be a string, got int"),
    ],
)
def test_malformed_descriptors_name_the_index_and_key(payload, message):
    with pytest.raises(ValueError, match=message):
        TreeDFA.from_token_trie(payload, end_token_id=0, cache=False)


@pytest.mark.parametrize(
    "token, problem",
    [
        (True, "is not an integer token id"),
        (np.bool_(True), "is not an integer token id"),
        (float("nan"), "is not an integer token id"),
        (1.0, "is not an integer token id"),
        ("1", "is not an integer token id"),
        (None, "is not an integer token id"),
        ([1], "is not an integer token id"),
        (-1, "is negative"),
        (-(10**30), "is negative"),
        (10**30, "exceeds the int32 range"),
        pytest.param(10**5000, "exceeds the int32 range", id="5001-digit-int"),
        (np.uint64(2**64 - 1), "exceeds the int32 range"),
        (np.int64(2**40), "exceeds the int32 range"),
    ],
)
def test_hostile_token_ids_are_named(token, problem):
    with pytest.raises(ValueError, match=rf"sequence 0: token .* at position 1 {problem}"):
        TreeDFA.from_sequences([[5, token]], end_token_id=0, cache=False)
    with pytest.raises(ValueError, match=rf"prefix_dict key '1': candidate .* {problem}"):
        TreeDFA.from_prefix_dict(dict(PREFIX_DICT, prefix_dict={"1": [5, token]}), cache=False)


def test_deeply_nested_json_is_a_clear_error():
    text = '{"descriptors": [{"leaves": [{"tokens": ' + "[" * 100000 + "]" * 100000 + "}]}]}"
    with pytest.raises(ValueError, match="nested too deeply"):
        TreeDFA.from_token_trie(text, end_token_id=0, cache=False)


@pytest.mark.parametrize("vocab_size", [0, -5, 2**31 + 1, 10**30, True, 5.0])
def test_vocab_size_outside_the_int32_token_range_is_refused(vocab_size):
    with pytest.raises(ValueError, match="vocab_size must be a positive integer up to 2\\*\\*31 or None"):
        TreeDFA.from_sequences([[5, 6]], end_token_id=2, vocab_size=vocab_size, cache=False)
    with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
        TreeDFA.from_prefix_dict(PREFIX_DICT, vocab_size=vocab_size, cache=False)
