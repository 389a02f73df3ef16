"""TreeDFA inputs: every loader, every bad-input case (a ValueError naming the key / leaf / token),
and the compile cache."""
import json
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from logitgate import TreeDFA
from logitgate.structured.compile_cache import LRUCache, content_hash
from logitgate.structured.tree.loaders import parse_prefix_dict, prefix_dict_problems

GOOD = {"start_token_id": 225, "end_token_id": 2, "sep": "_", "prefix_dict": {"225": [64000], "225_64000": [64001, 2]}}
PAYLOAD = {
    "modelId": "m1",
    "descriptors": [
        {"path": "action", "leaves": [{"name": "THINK", "tokens": [100, 101]}, {"name": "EXECUTE", "tokens": [200]}]},
        {"path": "parameters.mode", "leaves": [{"name": "fast", "tokens": [300]}, {"name": "slow", "tokens": [300, 301]}]},
    ],
}


def config_with(**changes):
    config = json.loads(json.dumps(GOOD))
    config.update(changes)
    return config


def dict_with(entries):
    return config_with(prefix_dict=entries)


def test_prefix_dict_from_path_json_string_and_dict_agree(tmp_path):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(GOOD))
    trees = [TreeDFA.from_prefix_dict(src, cache=False) for src in (GOOD, json.dumps(GOOD), str(path), path)]
    for tree in trees:
        assert tree.allowed(tree.root) == [64000]
        assert tree.allowed(tree.walk([64000])) == [2, 64001]


def test_json_text_with_a_byte_order_mark_is_json(tmp_path):
    """Text from a file saved with a UTF-8 BOM (Notepad, PowerShell), as a str, bytes or the file:
    JSON, never taken for a path; `load_tree_config` reads such a file too."""
    from logitgate.models.demo import load_tree_config

    text = "\ufeff" + json.dumps(GOOD)
    path = tmp_path / "tree.json"
    path.write_bytes(text.encode())
    for source in (text, text.encode(), path):
        assert TreeDFA.from_prefix_dict(source, cache=False).allowed(0) == [64000]
    assert load_tree_config(path) == GOOD


def test_default_separator_and_other_separators():
    config = {"start_token_id": 1, "end_token_id": 0, "prefix_dict": {"1": [5], "1_5": [6]}}
    assert TreeDFA.from_prefix_dict(config).allowed(TreeDFA.from_prefix_dict(config).walk([5])) == [6]
    config = {"start_token_id": 1, "end_token_id": 0, "sep": "::", "prefix_dict": {"1": [5], "1::5": [6]}}
    tree = TreeDFA.from_prefix_dict(config)
    assert tree.allowed(tree.walk([5])) == [6]


@pytest.mark.parametrize(
    "source, match",
    [
        ('{"start_token_id": 1,', "not valid JSON: .* line 1"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({"end_token_id": 2, "prefix_dict": {}}), "missing 'start_token_id'"),
        (json.dumps({"start_token_id": 2, "prefix_dict": {}}), "missing 'end_token_id'"),
        (json.dumps({"start_token_id": 1, "end_token_id": 2}), "missing 'prefix_dict'"),
        (json.dumps(config_with(start_token_id=-1)), "start_token_id -1 is negative"),
        (json.dumps(config_with(end_token_id="2")), "end_token_id '2' is not an integer"),
        (json.dumps(config_with(sep="")), "sep must be a non-empty string, got ''"),
        (json.dumps(config_with(sep="1")), "must not contain digits"),
        (json.dumps(config_with(prefix_dict=[1])), "'prefix_dict' must be a JSON object"),
    ],
)
def test_bad_configs(source, match):
    with pytest.raises(ValueError, match=match):
        TreeDFA.from_prefix_dict(source, cache=False)


@pytest.mark.parametrize(
    "entries, match",
    [
        ({"225_abc": [1]}, r"key '225_abc': part 'abc' is not a token id"),
        ({"225__5": [1]}, r"key '225__5': part '' is not a token id"),
        ({"225_-5": [1]}, r"key '225_-5': part '-5' is not a token id"),
        ({"225_007": [1]}, r"key '225_007': part '007' is not written the way RTP-LLM"),
        ({"225_99999999999": [1]}, r"key '225_99999999999': part '99999999999' exceeds the int32"),
        ({"225_5é": [1]}, r"key '225_5é': part '5é' is not a token id"),
        ({"225_5": [1, "7"]}, r"key '225_5': candidate '7' is not an integer token id"),
        ({"225_5": [1.5]}, r"key '225_5': candidate 1.5 is not an integer"),
        ({"225_5": [True]}, r"key '225_5': candidate True is not an integer"),
        ({"225_5": [None]}, r"key '225_5': candidate None is not an integer"),
        ({"225_5": [-3]}, r"key '225_5': candidate -3 is negative"),
        ({"225_5": 7}, r"key '225_5': candidates must be a list of token ids, got int"),
        ({"225_5": [2**40]}, r"key '225_5': candidate 1099511627776 exceeds the int32"),
    ],
)
def test_bad_keys_and_candidates_are_named(entries, match):
    entries = {"225": [5], **entries}
    with pytest.raises(ValueError, match=match):
        TreeDFA.from_prefix_dict(dict_with(entries), cache=False)
    with pytest.raises(ValueError, match=match):  # the JSON text path parses the same way
        TreeDFA.from_prefix_dict(json.dumps(dict_with(entries)), cache=False)


def test_non_string_keys_of_a_python_dict():
    with pytest.raises(ValueError, match="prefix_dict key 225 is not a string"):
        TreeDFA.from_prefix_dict(dict_with({225: [5]}), cache=False)


def test_ids_at_or_above_vocab_size():
    with pytest.raises(ValueError, match=r"key '225_64000': candidate 64001 is >= vocab_size 64001"):
        TreeDFA.from_prefix_dict(GOOD, vocab_size=64001, cache=False)
    with pytest.raises(ValueError, match=r"key '225': candidate 64000 is >= vocab_size 64000 \(and 2 more"):
        TreeDFA.from_prefix_dict(GOOD, vocab_size=64000, cache=False)
    with pytest.raises(ValueError, match="start_token_id 225 is >= vocab_size 200"):
        TreeDFA.from_prefix_dict(GOOD, vocab_size=200, cache=False)
    with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
        TreeDFA.from_prefix_dict(GOOD, vocab_size=0, cache=False)


def test_every_problem_is_listed_and_the_first_is_raised():
    config = dict_with({"225_x": [1], "225_5": [-1, "a"], "225_6": [300]})
    assert prefix_dict_problems(config, vocab_size=256) == [
        "prefix_dict key '225_x': part 'x' is not a token id",
        "prefix_dict key '225_5': candidate -1 is negative",
        "prefix_dict key '225_5': candidate 'a' is not an integer token id",
        "prefix_dict key '225_6': candidate 300 is >= vocab_size 256",
    ]
    assert prefix_dict_problems(config, vocab_size=256, limit=2) == prefix_dict_problems(config, vocab_size=256)[:2]
    assert prefix_dict_problems(config, vocab_size=3) == ["start_token_id 225 is >= vocab_size 3"]
    assert prefix_dict_problems(GOOD) == []
    with pytest.raises(ValueError, match=r"part 'x' is not a token id \(and 3 more"):
        TreeDFA.from_prefix_dict(config, vocab_size=256, cache=False)


def test_missing_file_and_bad_source_types(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        TreeDFA.from_prefix_dict(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match=r"file .*bad.json' is not valid JSON"):
        TreeDFA.from_prefix_dict(bad)
    with pytest.raises(ValueError, match="must be a dict, a JSON string or a path"):
        TreeDFA.from_prefix_dict(12)


def test_parsed_key_arrays():
    spec = parse_prefix_dict(dict_with({"225": [1], "225_64000_7": [3, 3, 4], "9": []}))
    assert spec.part_ids.tolist() == [225, 225, 64000, 7, 9]
    assert spec.part_offsets.tolist() == [0, 1, 4, 5]
    assert spec.cand_ids.tolist() == [1, 3, 3, 4] and spec.cand_offsets.tolist() == [0, 1, 4, 4]


def test_unreachable_keys_are_counted():
    config = dict_with({"225": [5], "225_5_6_7": [1], "226_5": [1], "225_5": [6]})
    stats = TreeDFA.from_prefix_dict(config, cache=False).stats()
    assert stats["unreachable_keys"] == 2  # "225_5_6" is missing; "226" is another start token
    assert stats["unreachable_examples"] == ["225_5_6_7", "226_5"]


# ---- token tries, sequences, strings -------------------------------------------------------------


def test_token_trie_payload_by_path():
    tree = TreeDFA.from_token_trie(PAYLOAD, end_token_id=0, path="parameters.mode")
    assert tree.allowed(tree.root) == [300]
    assert tree.allowed(tree.walk([300])) == [0, 301]  # "fast" ends where "slow" continues
    tree = TreeDFA.from_token_trie(json.dumps(PAYLOAD), end_token_id=0, path="action", model_id="m1")
    assert tree.allowed(tree.root) == [100, 200]
    assert tree.allowed(tree.walk([100, 101])) == [0]
    single = {"modelId": "m", "descriptors": [PAYLOAD["descriptors"][0]]}
    assert TreeDFA.from_token_trie(single, end_token_id=0).allowed(0) == [100, 200]


@pytest.mark.parametrize(
    "payload, kwargs, match",
    [
        (PAYLOAD, {}, r"has 2 descriptors \['action', 'parameters.mode'\]; choose one with path="),
        (PAYLOAD, {"path": "nope"}, "no descriptor with path 'nope'"),
        (PAYLOAD, {"path": "action", "model_id": "m2"}, "payload is for model 'm1', not 'm2'"),
        (PAYLOAD, {"path": "action", "vocab_size": 150}, r"leaf 'EXECUTE'\): token 200 at position 0 is >= vocab_size 150"),
        ({"modelId": "m", "descriptors": []}, {}, "no descriptors"),
        ({"modelId": "m", "descriptors": [{"path": "a", "leaves": []}]}, {}, "descriptor 'a' has no leaves"),
        ({"modelId": "m", "descriptors": [{"path": "a", "leaves": [{"name": "x"}]}]}, {}, "leaf 0 must be an object with 'tokens'"),
        ({"modelId": "m", "descriptors": [{"path": "a", "leaves": [{"name": "x", "tokens": [1, -4]}]}]}, {}, r"leaf 'x'\): token -4 at position 1 is negative"),
        ({"modelId": "m", "descriptors": [{"path": "a", "leaves": [{"name": "x", "tokens": [1, 0]}]}]}, {}, r"leaf 'x'\): token 0 at position 1 is the end token"),
        ({"modelId": "m"}, {}, "needs a 'descriptors' list"),
        ('{"modelId": ', {}, "not valid JSON"),
    ],
)
def test_bad_token_trie_payloads(payload, kwargs, match):
    with pytest.raises(ValueError, match=match):
        TreeDFA.from_token_trie(payload, end_token_id=0, cache=False, **kwargs)


def test_sequences_accept_tensors_and_arrays_and_reject_bad_ids():
    tree = TreeDFA.from_sequences([torch.tensor([5, 6]), np.array([5, 7]), (8,)], end_token_id=0)
    assert tree.allowed(tree.walk([5])) == [6, 7]
    with pytest.raises(ValueError, match="no sequences"):
        TreeDFA.from_sequences([], end_token_id=0)
    with pytest.raises(ValueError, match="sequence 1: token 'x' at position 0 is not an integer"):
        TreeDFA.from_sequences([[1], ["x"]], end_token_id=0)
    with pytest.raises(ValueError, match="sequence 0: token 9 at position 1 is >= vocab_size 9"):
        TreeDFA.from_sequences([[1, 9]], end_token_id=0, vocab_size=9)
    with pytest.raises(ValueError, match="end_token_id 12 is >= vocab_size 10"):
        TreeDFA.from_sequences([[1]], end_token_id=12, vocab_size=10)
    with pytest.raises(ValueError, match="sequence 0 must be a list of token ids, got int"):
        TreeDFA.from_sequences([3], end_token_id=0)


def test_empty_sequence_makes_the_root_terminal():
    tree = TreeDFA.from_sequences([[], [4]], end_token_id=0)
    assert tree.allowed(tree.root) == [0, 4]


def test_from_strings_with_a_tokenizer_callable():
    vocab = {"red": 10, "green": 11, "blue": 12, " ": 13}

    def tokenize(text):  # returns what a Hugging Face tokenizer returns for one string
        return {"input_ids": [vocab[w] for w in re.findall(r"\w+| ", text)]}

    tree = TreeDFA.from_strings(["red", "red green", "blue"], tokenize, end_token_id=0, vocab_size=20)
    assert tree.allowed(tree.root) == [10, 12]
    assert tree.allowed(tree.walk([10])) == [0, 13]
    assert tree.forced_tokens(tree.walk([10, 13]), 5) == [11, 0]
    plain = TreeDFA.from_strings(["red"], lambda s: [vocab[s]], end_token_id=0)
    assert plain.allowed(plain.root) == [10]
    with pytest.raises(ValueError, match=r"leaf 'blue'\): token 12 at position 0 is >= vocab_size 12"):
        TreeDFA.from_strings(["blue"], tokenize, end_token_id=0, vocab_size=12)
    with pytest.raises(ValueError, match="strings must be str"):
        TreeDFA.from_strings([b"red"], tokenize, end_token_id=0)


def test_scalar_api_rejects_bad_states_and_tokens():
    tree = TreeDFA.from_sequences([[1, 2]], end_token_id=0, vocab_size=10)
    for bad in (-1, tree.num_states, "0", 1.0, True):
        with pytest.raises(ValueError, match="is not a state of this tree"):
            tree.allowed(bad)
    with pytest.raises(ValueError, match="token -1 is negative"):
        tree.step(tree.root, -1)
    with pytest.raises(ValueError, match="token 10 is >= vocab_size 10"):
        tree.step(tree.root, 10)
    with pytest.raises(ValueError, match="max_len must be an int >= 0"):
        tree.forced_tokens(tree.root, -1)


def test_batched_api_rejects_bad_tensors():
    tree = TreeDFA.from_sequences([[1, 2]], end_token_id=0, vocab_size=100)  # on the default device
    states = tree.initial_states(2)
    with pytest.raises(ValueError, match="states must be a 1-D int32/int64 tensor"):
        tree.advance(states.float(), torch.tensor([1, 2], device=tree.device))
    with pytest.raises(ValueError, match="tokens have shape"):
        tree.advance(states, torch.tensor([1, 2, 3], device=tree.device))
    with pytest.raises(ValueError, match="tokens are on meta"):
        tree.advance(states, torch.zeros(2, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match="bitmask must be a 2-D int32"):
        tree.fill_bitmask(states, torch.zeros(2, 4, dtype=torch.int64, device=tree.device))
    with pytest.raises(ValueError, match="bitmask has 3 rows for 2 states"):
        tree.fill_bitmask(states, torch.zeros(3, 4, dtype=torch.int32, device=tree.device))
    with pytest.raises(ValueError, match="bitmask has 3 words per row; this tree needs 4"):
        tree.fill_bitmask(states, torch.zeros(2, 3, dtype=torch.int32, device=tree.device))
    with pytest.raises(ValueError, match="bitmask must be contiguous"):
        tree.fill_bitmask(states, torch.zeros(8, 2, dtype=torch.int32, device=tree.device).t())


# ---- compile cache ----------------------------------------------------------------------------


def test_compile_cache_reuses_trees_by_content():
    TreeDFA.cache_clear()
    a = TreeDFA.from_prefix_dict(json.dumps(GOOD))
    b = TreeDFA.from_prefix_dict(json.dumps(GOOD))
    c = TreeDFA.from_prefix_dict(dict(GOOD))
    d = TreeDFA.from_prefix_dict(json.loads(json.dumps(GOOD)))
    assert a is b and c is d and a is not c
    assert TreeDFA.from_prefix_dict(GOOD, vocab_size=70000) is not c  # other options: another entry
    assert TreeDFA.from_sequences([[1, 2]], end_token_id=0) is TreeDFA.from_sequences([(1, 2)], end_token_id=0)
    assert TreeDFA.from_sequences([[1, 2]], end_token_id=0) is not TreeDFA.from_sequences([[1, 2]], end_token_id=3)
    assert TreeDFA.from_prefix_dict(GOOD, cache=False) is not c
    info = TreeDFA.cache_info()
    assert info["hits"] == 4 and info["size"] == 5


def test_lru_cache_is_bounded():
    cache = LRUCache(2)
    for key in "abcb":
        cache.get_or_create(key, lambda k=key: k.upper())
    assert cache.info() == {"size": 2, "maxsize": 2, "bytes": 0, "max_bytes": None, "hits": 1, "misses": 3}
    cache.get_or_create("d", lambda: "D")  # evicts "c", the least recently used
    assert cache.get_or_create("c", lambda: "new") == "new"
    TreeDFA.set_cache_size(1)
    try:
        a = TreeDFA.from_sequences([[1]], end_token_id=0)
        TreeDFA.from_sequences([[2]], end_token_id=0)
        assert TreeDFA.from_sequences([[1]], end_token_id=0) is not a
    finally:
        TreeDFA.set_cache_size(32)


def test_content_hash_distinguishes_boundaries_and_dtypes():
    assert content_hash("ab", "c") != content_hash("a", "bc")
    assert content_hash(np.array([1], np.int64)) != content_hash(np.array([1], np.int32))
    assert content_hash(b"x", 1, None) == content_hash(b"x", 1, None)
    with pytest.raises(TypeError):
        content_hash(object())


@given(
    keys=st.lists(st.text(alphabet="0123456789_-x é", max_size=12), max_size=8, unique=True),
    sep=st.sampled_from(["_", "-", "__", " "]),
)
def test_vectorised_key_parse_agrees_with_split_and_int(keys, sep):
    config = {"start_token_id": 1, "end_token_id": 2, "sep": sep, "prefix_dict": {k: [3] for k in keys}}

    def canonical(part):
        return part.isascii() and part.isdigit() and (part == "0" or part[0] != "0") and int(part) <= 2**31 - 1

    if all(canonical(p) for k in keys for p in k.split(sep)):
        spec = parse_prefix_dict(config)
        parts = [int(p) for k in keys for p in k.split(sep)]
        assert spec.part_ids.tolist() == parts
        assert spec.part_offsets.tolist() == np.cumsum([0] + [len(k.split(sep)) for k in keys]).tolist()
    else:
        with pytest.raises(ValueError, match="prefix_dict key"):
            parse_prefix_dict(config)
        assert prefix_dict_problems(config)
