"""`logitgate tree inspect`: sizes and shape of a valid tree, every validation error with its key."""
import json

import pytest

from logitgate.cli import main

PREFIX = {"start_token_id": 225, "end_token_id": 2, "prefix_dict": {"225": [64000, 64005], "225_64000": [64001, 2], "226_5": [1]}}
PAYLOAD = {
    "modelId": "m1",
    "descriptors": [
        {"path": "action", "leaves": [{"name": "THINK", "tokens": [100, 101]}, {"name": "EXECUTE", "tokens": [200]}]},
        {"path": "mode", "leaves": [{"name": "fast", "tokens": [300]}, {"name": "bad", "tokens": [300, -1]}]},
    ],
}


@pytest.fixture
def write(tmp_path):
    def _write(obj, name="tree.json"):
        path = tmp_path / name
        path.write_text(json.dumps(obj))
        return str(path)

    return _write


def test_inspect_valid_prefix_dict(write, capsys):
    assert main(["tree", "inspect", write(PREFIX)]) == 0
    out = capsys.readouterr().out
    assert "rtp-llm prefix dict" in out
    assert "keys             3 (1 unreachable, e.g. ['226_5']); start 225, end 2, sep '_'" in out
    assert "nodes            2 (+ error and finished states)" in out
    assert "depth            1" in out
    assert "branching        2: 2" in out
    assert "bytes/node" in out


def test_inspect_lists_every_error_with_its_key(write, capsys):
    bad = {**PREFIX, "prefix_dict": {"225_x": [1], "225": [64000, "a"], "225_64000": [64001]}}
    assert main(["tree", "inspect", write(bad), "--vocab-size", "64001"]) == 1
    out = capsys.readouterr().out
    assert "3 validation error(s)" in out
    assert "prefix_dict key '225_x': part 'x' is not a token id" in out
    assert "prefix_dict key '225': candidate 'a' is not an integer token id" in out
    assert "prefix_dict key '225_64000': candidate 64001 is >= vocab_size 64001" in out


def test_inspect_token_trie_payload_per_descriptor(write, capsys):
    path = write(PAYLOAD)
    assert main(["tree", "inspect", path]) == 2
    assert "pass --end-token-id" in capsys.readouterr().err
    assert main(["tree", "inspect", path, "--end-token-id", "0"]) == 1
    out = capsys.readouterr().out
    assert "TokenTreePayload (modelId 'm1')" in out and "descriptor 'action':" in out
    assert "sequences        2 (2 distinct ends); end 0" in out
    assert "sequence 1 (leaf 'bad'): token -1 at position 1 is negative" in out
    assert main(["tree", "inspect", path, "--end-token-id", "0", "--path", "action", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trees"][0]["stats"]["nodes"] == 4 and report["trees"][0]["errors"] == []


def test_inspect_sequences_and_unusable_files(write, tmp_path, capsys):
    assert main(["tree", "inspect", write([[1, 2], [1, 3]], "seqs.json"), "--end-token-id", "0"]) == 0
    assert "token sequences" in capsys.readouterr().out
    assert main(["tree", "inspect", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["tree", "inspect", write({"a": 1}, "other.json"), "--end-token-id", "0"]) == 2
    assert "has none of the keys of a prefix-dict config (start_token_id, end_token_id, prefix_dict), a " \
        "TokenTreePayload (descriptors) or a list of token sequences; its keys: 'a'" in capsys.readouterr().err


@pytest.mark.parametrize("content, problem", [({}, "is an empty JSON object; expected a prefix-dict config"),
                                              (7, "is a JSON int; expected a prefix-dict config")])
def test_inspect_empty_or_scalar_file_says_what_is_expected(write, capsys, content, problem):
    path = write(content, "empty.json")
    assert main(["tree", "inspect", path]) == 2  # not "pass --end-token-id": the file is no tree at all
    err = capsys.readouterr().err
    assert f"tree file {path!r} {problem}" in err and "end-token-id" not in err


@pytest.mark.parametrize("bad_path, kind", [(["a", "b"], "list"), ({"p": 1}, "dict"), (7, "int")])
def test_inspect_malformed_descriptor_path_is_exit_status_2(write, capsys, bad_path, kind):
    # Issue 22.9: a list path used to end in "TypeError: unhashable type".
    payload = {"modelId": "m1", "descriptors": [PAYLOAD["descriptors"][0], {"path": bad_path, "leaves": []}]}
    assert main(["tree", "inspect", write(payload), "--end-token-id", "0"]) == 2
    err = capsys.readouterr().err
    assert f"logitgate: error: descriptor 1 key 'path' must be a string, got {kind}" in err


def test_inspect_refuses_a_file_beyond_the_operator_byte_limit(write, capsys, monkeypatch):
    monkeypatch.setenv("LOGITGATE_TREE_MAX_BYTES", "64")
    assert main(["tree", "inspect", write(PREFIX)]) == 2
    err = capsys.readouterr().err
    assert "is too large" in err and "over the limit of 64 bytes" in err and "LOGITGATE_TREE_MAX_BYTES" in err


def test_inspect_quotes_long_unreachable_keys_in_part(write, capsys):
    long_key = "226_" + "_".join(["5"] * 5000)
    assert main(["tree", "inspect", write({**PREFIX, "prefix_dict": {**PREFIX["prefix_dict"], long_key: [1]}})]) == 0
    out = capsys.readouterr().out
    assert f"... ({len(long_key)} characters)" in out and len(out) < 2000


# ---- logitgate tree build: strings + a tokenizer -> a prefix-dict file for LOGITGATE_TREE_DIR


def test_build_from_the_catalog_gives_the_shipped_tree(tmp_path, capsys):
    """The demo's catalog with its Hugging Face tokenizer directory, rooted at <root>: the very
    prefix dict the demo ships (logitgate/data/demo/tree.json)."""
    from logitgate.models.demo import CATALOG_PATH, EOS_ID, ROOT_ID, TARGET_DIR, load_tree_config

    out = tmp_path / "catalog.json"
    argv = ["tree", "build", str(CATALOG_PATH), "--tokenizer", str(TARGET_DIR), "--start-token-id", str(ROOT_ID), "--out", str(out)]
    assert main(argv) == 0
    built = json.loads(out.read_text())
    assert built == load_tree_config()
    assert built["end_token_id"] == EOS_ID  # the tokenizer's EOS by default
    assert "nodes" in capsys.readouterr().err
    assert main(["tree", "inspect", str(out)]) == 0


def test_build_for_llama3_and_its_start_tokens(tmp_path, capsys):
    """The start-token choice docs/vllm.md documents, checked on Llama-3's real tokenizer: text after
    <|reserved_special_token_0|> (128002, completions) or after the chat template's final "\\n\\n"
    (271) tokenizes as the string alone, so a tree built from the strings alone matches."""
    from logitgate import TreeDFA
    from tests.helpers.real_tokenizers import real_tokenizer

    tok = real_tokenizer("llama3")
    names = ["Asia/Tokyo", "Asia/Tomsk", "Europe/Paris", "America/New_York"]
    strings = tmp_path / "zones.txt"
    strings.write_text("\n".join(names) + "\n\n")
    header = tok.encode("<|start_header_id|>assistant<|end_header_id|>\n\n", add_special_tokens=False)
    assert header[-1] == 271 and tok.convert_ids_to_tokens(128002) == "<|reserved_special_token_0|>"
    for name in names:
        alone = tok.encode(name, add_special_tokens=False)
        assert tok.encode("\n\n" + name, add_special_tokens=False) == [271, *alone]
        assert tok.encode("<|reserved_special_token_0|>" + name, add_special_tokens=False) == [128002, *alone]
    for start, end in ((128002, None), (271, 128009)):
        out = tmp_path / f"zones_{start}.json"
        argv = ["tree", "build", str(strings), "--tokenizer", "llama3", "--start-token-id", str(start), "--out", str(out)]
        assert main(argv + ([] if end is None else ["--end-token-id", str(end)])) == 0
        config = json.loads(out.read_text())
        assert config["start_token_id"] == start and config["end_token_id"] == (end or tok.eos_token_id)
        tree = TreeDFA.from_prefix_dict(config, vocab_size=128256)
        for name in names:  # each string, then the end token, is a complete path
            state = tree.root
            for token in tok.encode(name, add_special_tokens=False) + [config["end_token_id"]]:
                assert token in tree.allowed(state)
                state = tree.step(state, token)
            assert tree.is_finished(state)
    capsys.readouterr()


def test_build_errors_name_the_problem(tmp_path, capsys):
    from logitgate.models.demo import TARGET_DIR

    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    strings = tmp_path / "s.txt"
    strings.write_text("Asia/Tokyo\n")
    cases = [
        ([str(empty), "--tokenizer", str(TARGET_DIR), "--start-token-id", "259"], "holds no strings"),
        ([str(tmp_path / "missing.txt"), "--tokenizer", str(TARGET_DIR), "--start-token-id", "259"], "missing.txt"),
        ([str(strings), "--tokenizer", "no-such-vocab", "--start-token-id", "259"], "neither a directory nor one of"),
        ([str(strings), "--tokenizer", str(TARGET_DIR), "--start-token-id", "5000"], "start_token_id 5000"),
        ([str(strings), "--tokenizer", str(TARGET_DIR), "--start-token-id", "65"], "holds the start or end token"),
    ]
    for argv, message in cases:
        assert main(["tree", "build", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv


def _built_strings(config: dict, tokenizer) -> set[str]:
    """Every string the built tree allows: its complete paths, decoded."""
    from logitgate import TreeDFA

    tree = TreeDFA.from_prefix_dict(config, vocab_size=len(tokenizer))
    found, stack = set(), [(tree.root, [])]
    while stack:
        state, tokens = stack.pop()
        for token in tree.allowed(state):
            if token == tree.end_token_id:
                found.add(tokenizer.decode(tokens))
            else:
                stack.append((tree.step(state, token), [*tokens, token]))
    return found


# Line breaks of str.splitlines() that are not "\n" or "\r\n": inside a string they are its text.
UNICODE_BREAKS = ["\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\r"]


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_build_splits_strings_at_newlines_only(tmp_path, capsys, newline):
    """One string a line, lines ending at "\\n" or "\\r\\n": every other Unicode line break
    (what str.splitlines() also breaks at) stays inside its string."""
    from logitgate.models.demo import TARGET_DIR, demo_hf_tokenizer

    strings = [f"Alpha{brk}Beta" for brk in UNICODE_BREAKS] + ["Gamma"]
    path = tmp_path / "strings.txt"
    path.write_bytes((newline.join(strings) + newline + newline).encode("utf-8"))
    out = tmp_path / "tree.json"
    argv = ["tree", "build", str(path), "--tokenizer", str(TARGET_DIR), "--start-token-id", "259", "--out", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    assert _built_strings(json.loads(out.read_text()), demo_hf_tokenizer()) == set(strings)


def test_build_drops_a_utf8_byte_order_mark(tmp_path, capsys):
    """A file saved by Notepad or PowerShell starts with a UTF-8 BOM: it is no part of the first string."""
    from logitgate.models.demo import TARGET_DIR, demo_hf_tokenizer

    path = tmp_path / "strings.txt"
    path.write_bytes(b"\xef\xbb\xbfYes\r\nNo\r\n")
    out = tmp_path / "tree.json"
    argv = ["tree", "build", str(path), "--tokenizer", str(TARGET_DIR), "--start-token-id", "259", "--out", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    assert _built_strings(json.loads(out.read_text()), demo_hf_tokenizer()) == {"Yes", "No"}


def test_build_out_that_cannot_be_written_is_exit_status_2(tmp_path, capsys):
    """--out in a missing folder, a folder, or under a file: exit status 2 naming the path, no traceback,
    nothing written; checked before the strings are tokenized."""
    from logitgate.models.demo import TARGET_DIR

    strings = tmp_path / "s.txt"
    strings.write_text("Asia/Tokyo\n")
    (tmp_path / "a-file").write_text("x")
    before = sorted(p.name for p in tmp_path.iterdir())
    for out in (tmp_path / "missing-dir" / "tree.json", tmp_path, tmp_path / "a-file" / "tree.json"):
        argv = ["tree", "build", str(strings), "--tokenizer", str(TARGET_DIR), "--start-token-id", "259", "--out", str(out)]
        assert main(argv) == 2, out
        err = capsys.readouterr().err
        assert f"--out {str(out)!r}" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_build_tokenizer_directory_that_cannot_be_loaded_names_it(tmp_path, capsys):
    strings = tmp_path / "s.txt"
    strings.write_text("Asia/Tokyo\n")
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    assert main(["tree", "build", str(strings), "--tokenizer", str(empty), "--start-token-id", "259"]) == 2
    assert f"--tokenizer {str(empty)!r}" in capsys.readouterr().err
