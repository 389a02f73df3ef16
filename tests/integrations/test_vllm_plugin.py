"""The vLLM plugin's import-light parts, without a vLLM engine: what LOGITGATE_VLLM_OPS selects, the
ops-module guard, that importing the plugin loads no numba, and how a request's tree is found
(its extra_args, an operator's named tree, the server-wide tree; never a client's path)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from logitgate.integrations.vllm import patches, plugin
from logitgate.integrations.vllm.tree.args import GLOBAL_TREE_ENV, TREE_DIR_ENV, resolve_tree_args, tree_request_for

CONFIG = {"start_token_id": 40, "end_token_id": 2, "prefix_dict": {"40": [10, 11], "40_10": [12]}}


@pytest.mark.parametrize("value, expected", [
    (None, frozenset(patches.OPS)), ("", frozenset(patches.OPS)), ("all", frozenset(patches.OPS)), ("none", frozenset()),
    ("tree", {"tree"}), (" Bitmask, sampler ", {"bitmask", "sampler"}), ("rejection,tree,", {"rejection", "tree"}),
])
def test_operations_selection(value, expected):
    assert plugin.selected_ops(value) == expected


def test_unknown_ops_are_an_error_not_a_silent_default():
    with pytest.raises(ValueError, match="LOGITGATE_VLLM_OPS='bitmsk,tree': unknown operation.*bitmsk"):
        plugin.selected_ops("bitmsk,tree")
    with pytest.raises(ValueError, match="none"):
        plugin.selected_ops("none,tree")


def test_logitgate_names_still_load_on_first_use():
    import logitgate

    assert logitgate.TreeDFA is __import__("logitgate.structured.tree", fromlist=["TreeDFA"]).TreeDFA
    assert set(logitgate.__all__) <= set(dir(logitgate))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        logitgate.nope  # noqa: B018


class Params:
    def __init__(self, extra_args=None):
        self.extra_args = extra_args


def test_requests_without_a_tree_and_without_a_global_tree(monkeypatch):
    monkeypatch.delenv(GLOBAL_TREE_ENV, raising=False)
    assert resolve_tree_args(None) is None and resolve_tree_args({"other": 1}) is None
    assert tree_request_for(Params({"other": 1})) is None
    with pytest.raises(ValueError, match="applies to 'token_trie'"):
        tree_request_for(Params({"end_token_id": 2}))


def test_dicts_and_json_strings_are_taken_as_they_are(monkeypatch):
    monkeypatch.delenv(TREE_DIR_ENV, raising=False)
    text = json.dumps(CONFIG)  # with a byte-order mark too (text read from a Notepad file): JSON, not a name
    for source in (CONFIG, text, "  " + text, "\ufeff" + text, "\ufeff\n" + text, ("\ufeff" + text).encode()):
        request = tree_request_for(Params({"tree_decode": source}))
        assert request.kind == "tree_decode" and request.compile(64).allowed(0) == [10, 11]


def test_client_paths_are_never_read(monkeypatch, tmp_path):
    (tmp_path / "t.json").write_text(json.dumps(CONFIG))
    monkeypatch.setenv(TREE_DIR_ENV, str(tmp_path))
    for bad in (str(tmp_path / "t.json"), "../t.json", "a/b", "..", Path(tmp_path / "t.json")):
        with pytest.raises(ValueError, match="path"):
            resolve_tree_args({"tree_decode": bad})
    with pytest.raises(ValueError, match="token_trie.*paths are not accepted"):
        resolve_tree_args({"token_trie": "/etc/passwd", "end_token_id": 2})


def test_names_resolve_in_the_operators_directory(monkeypatch, tmp_path):
    (tmp_path / "catalog.json").write_text(json.dumps(CONFIG))
    (tmp_path / "plain").write_text(json.dumps(CONFIG))
    monkeypatch.delenv(TREE_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match=f"no tree directory.*{TREE_DIR_ENV}"):
        resolve_tree_args({"tree_decode": "catalog"})
    monkeypatch.setenv(TREE_DIR_ENV, str(tmp_path))
    assert resolve_tree_args({"tree_decode": "catalog"})["tree_decode"] == tmp_path / "catalog.json"
    assert resolve_tree_args({"tree_decode": "plain"})["tree_decode"] == tmp_path / "plain"
    assert tree_request_for(Params({"tree_decode": "catalog"})).compile(64).allowed(0) == [10, 11]
    with pytest.raises(ValueError, match="no tree named 'missing'"):
        resolve_tree_args({"tree_decode": "missing"})


def test_a_request_object_is_resolved_once(monkeypatch, tmp_path):
    """The front end's resolve is kept on the params: the engine, given the same object in the same
    process, does not look the names up again; new extra_args or a changed tree directory resolve anew."""
    from logitgate.integrations.vllm.tree import args as tree_args

    (tmp_path / "catalog.json").write_text(json.dumps(CONFIG))
    monkeypatch.setenv(TREE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(GLOBAL_TREE_ENV, raising=False)
    calls = []
    real = tree_args.resolve_tree_args
    monkeypatch.setattr(tree_args, "resolve_tree_args", lambda args: calls.append(args) or real(args))
    params = Params({"tree_decode": "catalog"})
    first = tree_request_for(params)
    assert tree_request_for(params) is first and len(calls) == 1
    assert tree_request_for(Params({"tree_decode": "catalog"})) == first and len(calls) == 2  # another request
    params.extra_args = {"tree_decode": json.dumps(CONFIG)}
    assert tree_request_for(params).source == json.dumps(CONFIG) and len(calls) == 3
    monkeypatch.setenv(TREE_DIR_ENV, str(tmp_path / "elsewhere"))
    tree_request_for(params)
    assert len(calls) == 4
    bad = Params({"tree_decode": "missing"})
    for _ in range(2):  # errors are not kept: each call names the problem
        with pytest.raises(ValueError, match="no tree"):
            tree_request_for(bad)


def test_the_global_tree_applies_to_requests_without_their_own(monkeypatch, tmp_path):
    path = tmp_path / "global.json"
    path.write_text(json.dumps(CONFIG))
    monkeypatch.setenv(GLOBAL_TREE_ENV, str(path))
    request = tree_request_for(Params(None))
    assert request.kind == "tree_decode" and request.compile(64).allowed(0) == [10, 11]
    assert tree_request_for(Params({"other": 1})).kind == "tree_decode"
    trie = {"modelId": "m", "descriptors": [{"path": "p", "leaves": [{"name": "x", "tokens": [20]}]}]}
    own = tree_request_for(Params({"token_trie": trie, "end_token_id": 2}))  # a request's own tree wins
    assert own.kind == "token_trie"
    monkeypatch.setenv(GLOBAL_TREE_ENV, str(tmp_path / "gone.json"))
    with pytest.raises(ValueError, match=f"{GLOBAL_TREE_ENV}=.*gone.json"):
        tree_request_for(Params(None))


def test_a_server_wide_tree_over_the_byte_limit_stops_start_up_as_its_requests_would_fail(monkeypatch, tmp_path):
    """The start-up check reads the server-wide tree as every request's admission does: within
    LOGITGATE_TREE_MAX_BYTES (a file past it used to pass start-up, then fail every request with a
    400), and with or without a UTF-8 byte-order mark."""
    from logitgate.integrations.vllm.tree.admission import admit
    from logitgate.integrations.vllm.tree.args import check_global_tree

    path = tmp_path / "global.json"
    text = json.dumps(CONFIG)
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    monkeypatch.setenv(GLOBAL_TREE_ENV, str(path))
    check_global_tree()
    size = len(text) + 3
    monkeypatch.setenv("LOGITGATE_TREE_MAX_BYTES", str(size))
    check_global_tree()
    assert admit(tree_request_for(Params(None)), 64, None).nodes == 2
    monkeypatch.setenv("LOGITGATE_TREE_MAX_BYTES", str(size - 1))
    limit = f"its size is {size} bytes, over the limit of {size - 1} bytes"
    with pytest.raises(ValueError, match=f"{GLOBAL_TREE_ENV}=.*cannot serve as the server-wide tree: .*{limit}"):
        check_global_tree()
    with pytest.raises(ValueError, match=limit):
        admit(tree_request_for(Params(None)), 64, None)
