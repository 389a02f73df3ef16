"""The vLLM front end's tree admission (integrations/vllm/tree_admission.py): parsed, checked
against the vocabulary and the operator's limits, never compiled (issue 22: a huge tree compiled
twice, on the API server's event loop and in the engine)."""
from __future__ import annotations

import json

import pytest

from logitgate import TreeDFA
from logitgate.integrations.vllm.tree_admission import admit
from logitgate.integrations.vllm.tree_args import tree_request_for
from logitgate.sampling import SamplingParams

V = 64
CONFIG = {"start_token_id": 40, "end_token_id": 2, "prefix_dict": {"40": [10, 11], "40_10": [12, 13], "40_10_12": [2]}}
TRIE = {"modelId": "m", "descriptors": [{"path": "p", "leaves": [{"name": "a", "tokens": [5, 6, 7]}, {"name": "b", "tokens": [5, 8]}]}]}


def request(**extra_args):
    return tree_request_for(SamplingParams(extra_args=extra_args))


def test_shapes_without_compiling():
    TreeDFA.cache_clear()
    shape = admit(request(tree_decode=json.dumps(CONFIG)), V, None)
    assert shape == (40, 2, 6 + 5, 3)  # 6 key parts + 5 candidates; the longest key has 3 parts
    assert admit(request(token_trie=TRIE, end_token_id=3), V, None) == (None, 3, 5, 3)
    assert admit(request(token_trie=json.dumps(TRIE)), V, eos_token_id=1).end_token_id == 1  # the model's eos
    assert TreeDFA.cache_info()["size"] == 0


@pytest.mark.parametrize("env, value, source, match", [
    ("LOGITGATE_TREE_MAX_BYTES", "100", json.dumps(CONFIG), r"prefix dict config is too large: its size is \d+ bytes, over the limit of 100 bytes"),
    ("LOGITGATE_TREE_MAX_NODES", "10", CONFIG, r"the prefix dict \(key parts and candidates\) is too large: its node count is 11 nodes, over the limit of 10"),
    ("LOGITGATE_TREE_MAX_DEPTH", "2", CONFIG, r"the prefix dict \(longest key\) is too large: its depth is 3 tokens, over the limit of 2"),
    ("LOGITGATE_TREE_MAX_DEPTH", "2", TRIE, r"the token trie \(longest leaf\) is too large: its depth is 3 tokens"),
    ("LOGITGATE_TREE_MAX_NODES", "4", TRIE, r"the token trie \(leaf tokens\) is too large: its node count is 5 nodes"),
])
def test_the_operators_limits(monkeypatch, env, value, source, match):
    monkeypatch.setenv(env, value)
    key = "tree_decode" if source in (CONFIG, json.dumps(CONFIG)) else "token_trie"
    args = {key: source} if key == "tree_decode" else {key: source, "end_token_id": 3}
    with pytest.raises(ValueError, match=f"extra_args\\['{key}'\\]: {match}.* \\(the operator's setting {env}\\)"):
        admit(request(**args), V, None)
    monkeypatch.setenv(env, "1000")  # raised: admitted
    admit(request(**args), V, None)


def test_a_hostile_trie_leaf_is_refused_before_its_tokens_are_checked(monkeypatch):
    huge = {"descriptors": [{"path": "p", "leaves": [{"tokens": ["x"] * 500_000}]}]}
    with pytest.raises(ValueError, match="longest leaf.* its depth is 500000 tokens"):
        admit(request(token_trie=huge, end_token_id=1), V, None)


def test_the_operators_trees_are_limited_alike_and_parsed_once_per_content(monkeypatch, tmp_path):
    monkeypatch.setenv("LOGITGATE_TREE_DIR", str(tmp_path))
    (tmp_path / "t.json").write_text(json.dumps(CONFIG))
    assert admit(request(tree_decode="t"), V, None).depth == 3
    monkeypatch.setenv("LOGITGATE_TREE_MAX_DEPTH", "1")
    with pytest.raises(ValueError, match="LOGITGATE_TREE_MAX_DEPTH"):
        admit(request(tree_decode="t"), V, None)
    monkeypatch.delenv("LOGITGATE_TREE_MAX_DEPTH")
    (tmp_path / "t.json").write_text(json.dumps({**CONFIG, "prefix_dict": {"40": [V]}}))  # changed on disk
    with pytest.raises(ValueError, match=f"candidate {V} is >= vocab_size {V}"):
        admit(request(tree_decode="t"), V, None)


def test_a_tree_sent_again_is_not_parsed_again(monkeypatch):
    from logitgate.integrations.vllm import tree_admission

    text = json.dumps({**CONFIG, "prefix_dict": {**CONFIG["prefix_dict"], "40_11": [2]}})
    admit(request(tree_decode=text), V, None)
    monkeypatch.setattr(tree_admission, "_shape", lambda *args: pytest.fail("parsed again"))
    assert admit(request(tree_decode=text), V, None).nodes == 8 + 6  # key parts + candidates
