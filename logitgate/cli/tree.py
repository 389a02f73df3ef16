"""`logitgate tree inspect FILE [--vocab-size N]`: what a tree-decode file compiles to (nodes, depth,
branching histogram, memory) or every validation error, each naming its key / leaf / token.

FILE is an RTP-LLM prefix-dict config, a TokenTreePayload (needs --end-token-id) or a JSON list of
token sequences (needs --end-token-id). Exit status: 0 valid, 1 validation errors, 2 unusable input
(unreadable, malformed JSON or payload structure, or beyond the operator's limits LOGITGATE_TREE_MAX_*).

`logitgate tree build STRINGS --tokenizer DIR|NAME --start-token-id N [--end-token-id N] [--out FILE]`:
the prefix-dict config (a file for LOGITGATE_TREE_DIR) whose tree allows exactly the strings of
STRINGS (one a line: `load_catalog`), tokenized as `TreeDFA.from_strings` does. Exit status 0, or 2
for bad input (a file that cannot be read, an --out that cannot be written, checked first).
"""
from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers: Any) -> None:
    """Add the `tree` command group to the top-level parser's subparsers."""
    tree = subparsers.add_parser("tree", help="tree-decode tools (inspect a prefix dict / token trie)")
    tree_sub = tree.add_subparsers(dest="tree_command", required=True)
    inspect = tree_sub.add_parser("inspect", help="validate a tree file and print its compiled size and shape")
    inspect.add_argument("file", help="prefix-dict config, TokenTreePayload or JSON list of token sequences")
    inspect.add_argument("--vocab-size", type=int, default=None, help="reject token ids >= N")
    inspect.add_argument("--end-token-id", type=int, default=None, help="end token (token tries and sequences)")
    inspect.add_argument("--path", default=None, help="TokenTreePayload descriptor path (default: all)")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(func=cmd_inspect)
    build = tree_sub.add_parser("build", help="strings (one a line) + a tokenizer -> a prefix-dict JSON")
    build.add_argument("strings", help="UTF-8 text file, one allowed string a line: lines end at \\n or \\r\\n only, "
                       "blank lines are ignored, a byte-order mark is dropped")
    build.add_argument("--tokenizer", required=True, metavar="DIR|NAME",
                       help="a local Hugging Face tokenizer directory (nothing is downloaded) or a real vocabulary "
                       "name of logitgate.models.real_vocab (llama3, qwen2, llama2, gpt2, phi3, deepseek-coder)")
    build.add_argument("--start-token-id", type=int, required=True,
                       help="the token every prompt ends with (docs/vllm.md, 'Start tokens')")
    build.add_argument("--end-token-id", type=int, default=None, help="the token after each string (default: EOS)")
    build.add_argument("--out", default=None, metavar="FILE", help="write the JSON here (default: stdout)")
    build.set_defaults(func=cmd_build)


def cmd_inspect(args: argparse.Namespace) -> int:
    report = inspect_file(args.file, vocab_size=args.vocab_size, end_token_id=args.end_token_id, path=args.path)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if any(tree["errors"] for tree in report["trees"]) else 0


def inspect_file(
    file: str, *, vocab_size: int | None = None, end_token_id: int | None = None, path: str | None = None
) -> dict[str, Any]:
    """{"file", "format", "trees": [{"name", "errors", "stats"}]}; raises ValueError when the file
    cannot be read or its format needs an option that is missing."""
    from ..structured.tree.limits import TreeLimits
    from ..structured.tree.loaders import check_vocab_size, load_json, prefix_dict_problems

    check_vocab_size(vocab_size)
    # The operator's byte limit (LOGITGATE_TREE_MAX_BYTES) applies here as when serving the tree.
    obj, _ = load_json(file, "tree", TreeLimits.from_env())  # messages read "tree file '<path>' ..."
    formats = ("a prefix-dict config (start_token_id, end_token_id, prefix_dict), a TokenTreePayload "
               "(descriptors) or a list of token sequences")
    if isinstance(obj, dict) and not obj:
        raise ValueError(f"tree file {file!r} is an empty JSON object; expected {formats}")
    if isinstance(obj, dict) and not {"prefix_dict", "start_token_id", "descriptors"} & obj.keys():
        raise ValueError(f"tree file {file!r} has none of the keys of {formats}; its keys: {', '.join(map(repr, obj))}")
    if isinstance(obj, dict) and ("prefix_dict" in obj or "descriptors" not in obj):
        errors = prefix_dict_problems(obj, vocab_size)
        tree = _inspect_one(
            "prefix dict", errors, lambda cls: cls.from_prefix_dict(obj, vocab_size=vocab_size, device="cpu", cache=False)
        )
        return {"file": file, "format": "rtp-llm prefix dict", "trees": [tree]}
    if not isinstance(obj, (dict, list)):
        raise ValueError(f"tree file {file!r} is a JSON {type(obj).__name__}; expected {formats}")
    if end_token_id is None:
        raise ValueError("token tries and sequence lists have no end token: pass --end-token-id")
    if isinstance(obj, dict):
        return {"file": file, "format": "TokenTreePayload", "model_id": obj.get("modelId"),
                "trees": _inspect_payload(obj, end_token_id, vocab_size, path)}
    tree = _inspect_sequences("sequences", obj, None, end_token_id, vocab_size)
    return {"file": file, "format": "token sequences", "trees": [tree]}


def cmd_build(args: argparse.Namespace) -> int:
    import sys

    from .output_paths import check_output_file, write_output_file

    if args.out is not None:  # before the strings are tokenized
        check_output_file(args.out)
    config, stats = build_prefix_dict_file(args.strings, args.tokenizer, args.start_token_id, args.end_token_id)
    text = json.dumps(config, separators=(",", ":"))
    if args.out is None:
        print(text)
    else:
        write_output_file(args.out, text + "\n")
    print(f"{len(config['prefix_dict'])} keys, {stats['nodes']} nodes, depth {stats['max_depth']}; "
          f"start {config['start_token_id']}, end {config['end_token_id']}", file=sys.stderr)
    return 0


def load_tokenizer_arg(spec: str) -> Any:
    """A local Hugging Face tokenizer directory (offline), else a real_vocab name."""
    from pathlib import Path

    from ..models.real_vocab import VOCABS, load_tokenizer

    if Path(spec).is_dir():
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(spec, local_files_only=True)
        except (OSError, ValueError) as exc:  # no tokenizer files there, or files transformers cannot read
            raise ValueError(f"--tokenizer {spec!r} is not a loadable Hugging Face tokenizer directory: {exc}") from None
    if spec in VOCABS:
        return load_tokenizer(spec)
    raise ValueError(f"--tokenizer {spec!r} is neither a directory nor one of {', '.join(sorted(VOCABS))}")


def build_prefix_dict_file(
    strings_file: str, tokenizer: Any, start_token_id: int, end_token_id: int | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefix-dict config, its compiled tree's stats) for the strings in `strings_file` under
    `tokenizer` (an object, or a `--tokenizer` argument). The tree compiles with the tokenizer's
    vocabulary size before it is returned, so a bad token id is an error here, not on the server."""
    from ..models.demo import build_prefix_dict, load_catalog
    from ..structured.tree import TreeDFA
    from ..structured.tree.loaders import check_token_id, tokenize_strings

    tok = load_tokenizer_arg(tokenizer) if isinstance(tokenizer, str) else tokenizer
    try:
        strings = load_catalog(strings_file)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"strings file {strings_file!r}: {exc}") from exc
    if not strings:
        raise ValueError(f"strings file {strings_file!r} holds no strings")
    if end_token_id is None:
        end_token_id = tok.eos_token_id
        if end_token_id is None:
            raise ValueError("the tokenizer has no EOS token: pass --end-token-id")
    vocab_size = len(tok)
    check_token_id(start_token_id, "start_token_id", vocab_size)
    check_token_id(end_token_id, "end_token_id", vocab_size)
    sequences, _ = tokenize_strings(strings, tok)
    for name, seq in zip(strings, sequences):
        if start_token_id in seq or end_token_id in seq:
            raise ValueError(f"string {name!r} tokenizes to {seq}, which holds the start or end token")
    config = build_prefix_dict(sequences, start_token_id=start_token_id, end_token_id=end_token_id)
    stats = TreeDFA.from_prefix_dict(config, vocab_size=vocab_size, device="cpu", cache=False).stats()
    return config, stats


def _inspect_payload(obj: dict, end_token_id: int, vocab_size: int | None, path: str | None) -> list[dict]:
    from ..structured.tree.loaders import parse_token_trie, quote_key, token_trie_descriptors

    descriptors = token_trie_descriptors(obj)  # ValueError (exit status 2) naming a malformed descriptor
    if path is None and len(descriptors) > 1:  # inspect each one
        paths = list(dict.fromkeys(d.get("path") for d in descriptors))
    else:
        paths = [path]
    trees = []
    for p in paths:
        try:
            parsed = parse_token_trie(obj, path=p)
        except ValueError as exc:
            trees.append({"name": f"descriptor {p if p is None else repr(quote_key(p))}", "errors": [str(exc)], "stats": None})
            continue
        name = f"descriptor {parsed.path if parsed.path is None else repr(quote_key(parsed.path))}"
        trees.append(_inspect_sequences(name, parsed.sequences, parsed.names, end_token_id, vocab_size))
    return trees


def _inspect_sequences(
    name: str, sequences: list, names: list[str] | None, end_token_id: int, vocab_size: int | None
) -> dict:
    from ..structured.tree.loaders import check_token_id, sequence_problems

    try:
        check_token_id(end_token_id, "end_token_id", vocab_size)
        errors = sequence_problems(sequences, end_token_id, vocab_size, names)
        errors = errors or ([] if sequences else ["no sequences"])
    except ValueError as exc:
        errors = [str(exc)]
    return _inspect_one(name, errors, lambda tree_cls: tree_cls.from_sequences(
        sequences, end_token_id=end_token_id, vocab_size=vocab_size, names=names, device="cpu", cache=False))


def _inspect_one(name: str, errors: list[str], build) -> dict:
    from ..structured.tree import TreeDFA

    return {"name": name, "errors": errors, "stats": None if errors else build(TreeDFA).stats()}


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def format_report(report: dict[str, Any]) -> str:
    model = f" (modelId {report['model_id']!r})" if report.get("model_id") else ""
    lines = [f"{report['file']}: {report['format']}{model}"]
    for tree in report["trees"]:
        lines.append(f"  {tree['name']}:")
        if tree["errors"]:
            lines.append(f"    {len(tree['errors'])} validation error(s):")
            lines.extend(f"      {err}" for err in tree["errors"])
            continue
        s = tree["stats"]
        if "keys" in s:
            unreachable = ""
            if s["unreachable_keys"]:
                unreachable = f" ({s['unreachable_keys']} unreachable, e.g. {s['unreachable_examples']})"
            ids = f"start {s['start_token_id']}, end {s['end_token_id']}, sep {s['sep']!r}"
            lines.append(f"    keys             {s['keys']}{unreachable}; {ids}")
        else:
            ends = f"{s['terminal_nodes']} distinct ends"
            lines.append(f"    sequences        {s['sequences']} ({ends}); end {s['end_token_id']}")
        lines.append(f"    nodes            {s['nodes']} (+ error and finished states)")
        lines.append(f"    depth            {s['max_depth']}")
        lines.append(f"    transitions      {s['transitions']}; allowed entries {s['allowed_entries']}")
        lines.append(f"    max width        {s['max_width']} (sparse fill width {s['sparse_fill_width']})")
        lines.append("    branching        " + "  ".join(f"{k}: {v}" for k, v in s["branching"].items()))
        lines.append(
            f"    memory           {_bytes(s['device_bytes'])} on {s['device']} ({s['bytes_per_node']:.1f} bytes/node; "
            f"{s['dense_rows']} dense bitmask rows, {_bytes(s['dense_bytes'])})"
        )
    return "\n".join(lines)
