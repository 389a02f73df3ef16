"""Reading and validating tree-decode inputs: RTP-LLM prefix dicts, TokenTreePayloads, token sequences.

The fast paths are vectorised with numpy (a 1M-key prefix dict must load in about a second). When a
fast check fails, the slow path walks the input in Python to name the offending key, leaf or token;
`prefix_dict_problems` / `sequence_problems` return every problem (the CLI lists them all).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ...checks import is_integer, is_integer_type, short_repr
from ...json_text import is_json_text
from .limits import TreeLimits

INT32_MAX = 2**31 - 1
DEFAULT_SEP = "_"
_KEY_DELIM = "\x00"  # joins keys for the vectorised parse; never valid inside a key
_PART_DELIM = "\x01"  # stands in for the separator during the vectorised parse
_MAX_DIGITS = 10  # INT32_MAX has 10 digits
_DELIMS_TO_SPACES = bytes.maketrans(b"\x00\x01", b"  ")
_PROBLEM_LIMIT = 20  # problems collected before raising (the first one is the message)
_QUOTE_CHARS = 80  # a key, leaf name or path is quoted at most this long in messages and logs


@dataclass(frozen=True)
class PrefixDictSpec:
    """A parsed RTP-LLM prefix dict: key i is `part_ids[part_offsets[i]:part_offsets[i+1]]` (the
    start token first) and allows `cand_ids[cand_offsets[i]:cand_offsets[i+1]]` (as listed)."""

    start_token_id: int
    end_token_id: int
    sep: str
    keys: list[str]
    part_ids: np.ndarray
    part_offsets: np.ndarray
    cand_ids: np.ndarray
    cand_offsets: np.ndarray


@dataclass(frozen=True)
class SequenceSpec:
    """Allowed token sequences, flattened: sequence i is `token_ids[offsets[i]:offsets[i+1]]`."""

    token_ids: np.ndarray
    offsets: np.ndarray
    names: list[str] | None = None


class TreeSize(NamedTuple):
    """What the operator's node and depth limits (LOGITGATE_TREE_MAX_NODES, _DEPTH) count in a tree,
    from its parsed form, before its trie is built. The vLLM front end's admission and the compile
    count with the same functions (`sequences_size`, `prefix_dict_size`), so a tree admitted is a
    tree that compiles, whatever its size."""

    nodes: int  # the root included; at least the compiled tree's nodes
    depth: int  # tokens along the longest sequence / key (after a prefix dict's start token)


def sequences_size(lengths: np.ndarray) -> TreeSize:
    """Token sequences of these lengths: the root and a node per token as written (the trie before
    shared prefixes merge, which is what building it allocates), and the longest sequence."""
    lengths = np.asarray(lengths, np.int64)
    return TreeSize(1 + int(lengths.sum()), int(lengths.max()) if lengths.size else 0)


def prefix_dict_size(spec: PrefixDictSpec) -> TreeSize:
    """A prefix dict: the root (the start token's key) and a node per longer key (a node exists only
    where its key does, so a tree whose keys are all reachable has exactly this many), and the most
    tokens after the start token in a key, unreachable keys included."""
    tokens = np.diff(spec.part_offsets) - 1  # every key has at least one part
    return TreeSize(1 + int(np.count_nonzero(tokens)), int(tokens.max()) if tokens.size else 0)


@dataclass(frozen=True)
class TokenTriePayload:
    """The chosen descriptor of a TokenTreePayload."""

    model_id: str | None
    path: str | None
    names: list[str]
    sequences: list[Any]


# ---------------------------------------------------------------------------------------------
# JSON sources


def read_json_source(source: Any, what: str, limits: TreeLimits | None = None) -> tuple[Any, bytes | None, str]:
    """(parsed object or None, raw bytes or None, a description for messages) without parsing, so
    callers can hash the raw text first. `source` is a parsed dict/list, a JSON string, bytes, or a
    path (str or PathLike). With `limits`, text beyond limits.max_bytes raises TreeTooLarge before
    it is parsed (a file is read no further than that; a parsed dict/list is not measured)."""
    max_bytes = None if limits is None else limits.max_bytes
    if isinstance(source, (dict, list)):
        return source, None, what
    if isinstance(source, (bytes, bytearray)):
        raw = bytes(source)
    elif isinstance(source, str) and is_json_text(source):  # JSON reads a byte-order mark in bytes
        if max_bytes is not None and len(source) > max_bytes:  # a char is at least a byte: skip the encode
            limits.check_bytes(len(source), what)
        raw = source.encode("utf-8", "surrogatepass")
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        what = f"{what} file {str(path)!r}"
        try:
            raw = path.read_bytes() if limits is None else limits.read_file(path, what)
        except FileNotFoundError:
            raise ValueError(f"{what} does not exist") from None
        except OSError as exc:
            raise ValueError(f"{what} cannot be read: {exc}") from None
    else:
        raise ValueError(f"{what} must be a dict, a JSON string or a path, got {type(source).__name__}")
    if limits is not None:
        limits.check_bytes(len(raw), what)
    return None, raw, what


def parse_json_bytes(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON: not UTF-8 text ({exc.reason})") from None
    except RecursionError:
        raise ValueError(f"{where} is nested too deeply to be a tree") from None
    except ValueError as exc:  # e.g. a number of more than 4300 digits (Python's int limit)
        raise ValueError(f"{where} cannot be read: {exc}") from None


def load_json(source: Any, what: str, limits: TreeLimits | None = None) -> tuple[Any, bytes | None]:
    """(parsed object, raw bytes or None); ValueError for a missing file or malformed JSON,
    TreeTooLarge for text beyond `limits` (read_json_source)."""
    obj, raw, where = read_json_source(source, what, limits)
    return (obj if raw is None else parse_json_bytes(raw, where)), raw


# ---------------------------------------------------------------------------------------------
# single values


def quote_key(text: Any) -> str:
    """`text` (a key, leaf name or path) for a message or a log line: whole when short, else its
    first 80 characters and its length, so that a client's 40k-character key cannot flood a log."""
    if not isinstance(text, str):
        return short_repr(text)
    if len(text) <= _QUOTE_CHARS:
        return text
    return f"{text[:_QUOTE_CHARS]}... ({len(text)} characters)"


def quote_list(texts: Sequence[Any], limit: int = 5) -> str:
    """Up to `limit` of `texts`, each quoted by quote_key, and how many more there are."""
    shown = ", ".join(repr(quote_key(t)) if isinstance(t, str) else short_repr(t) for t in texts[:limit])
    more = f", ... ({len(texts) - limit} more)" if len(texts) > limit else ""
    return f"[{shown}{more}]"


def token_problem(value: Any, vocab_size: int | None) -> str | None:
    """Why `value` is not a token id, or None."""
    if not is_integer(value):
        return "is not an integer token id"
    if value < 0:
        return "is negative"
    if value > INT32_MAX:
        return "exceeds the int32 range of token ids"
    if vocab_size is not None and value >= vocab_size:
        return f"is >= vocab_size {vocab_size}"
    return None


def _key_part_problem(part: str, vocab_size: int | None) -> str | None:
    if not (part.isascii() and part.isdigit()):
        return "is not a token id"
    if len(part) > 1 and part[0] == "0":
        # RTP-LLM builds keys with std::to_string, so a key spelled like this is never looked up.
        return "is not written the way RTP-LLM writes token ids (leading zero), so the key can never match"
    if len(part) > len(str(INT32_MAX)):  # before int(): Python refuses more than 4300 digits
        return "exceeds the int32 range of token ids"
    return token_problem(int(part), vocab_size)


def check_vocab_size(vocab_size: int | None) -> None:
    # Token ids are int32: a larger vocabulary would only size bitmasks no tensor can hold.
    if vocab_size is not None and (not is_integer(vocab_size) or not 0 < vocab_size <= INT32_MAX + 1):
        raise ValueError(f"vocab_size must be a positive integer up to 2**31 or None, got {short_repr(vocab_size)}")


def check_token_id(value: Any, name: str, vocab_size: int | None) -> int:
    problem = token_problem(value, vocab_size)
    if problem:
        raise ValueError(f"{name} {short_repr(value)} {problem}")
    return int(value)


def _raise_problems(problems: list[str], what: str) -> None:
    if not problems:  # the fast path and the slow path disagree: a bug, but say something useful
        raise ValueError(f"{what} is invalid")
    more = f" (and {len(problems) - 1} more; `logitgate tree inspect` lists them)" if len(problems) > 1 else ""
    raise ValueError(problems[0] + more)


# ---------------------------------------------------------------------------------------------
# RTP-LLM prefix dicts


def _prefix_dict_header(obj: Any, vocab_size: int | None) -> tuple[int, int, str, dict]:
    if not isinstance(obj, dict):
        raise ValueError(f"prefix dict config must be a JSON object, got {type(obj).__name__}")
    ids = []
    for name in ("start_token_id", "end_token_id"):
        if name not in obj:
            raise ValueError(f"prefix dict config is missing {name!r}")
        ids.append(check_token_id(obj[name], name, vocab_size))
    sep = obj.get("sep", DEFAULT_SEP)
    if not isinstance(sep, str) or not sep:
        raise ValueError(f"sep must be a non-empty string, got {sep!r}")
    if any(c.isdigit() or c in (_KEY_DELIM, _PART_DELIM) for c in sep):
        raise ValueError(f"sep {sep!r} must not contain digits or control characters \\x00/\\x01")
    if "prefix_dict" not in obj:
        raise ValueError("prefix dict config is missing 'prefix_dict'")
    prefix_dict = obj["prefix_dict"]
    if not isinstance(prefix_dict, dict):
        raise ValueError(f"'prefix_dict' must be a JSON object of key -> candidate list, got {type(prefix_dict).__name__}")
    return ids[0], ids[1], sep, prefix_dict


def prefix_dict_problems(obj: Any, vocab_size: int | None = None, limit: int | None = None) -> list[str]:
    """Every problem of a prefix-dict config (up to `limit`), each naming its key and token."""
    try:
        check_vocab_size(vocab_size)
        _, _, sep, prefix_dict = _prefix_dict_header(obj, vocab_size)
    except ValueError as exc:
        return [str(exc)]
    problems: list[str] = []
    for key, cands in prefix_dict.items():
        if limit is not None and len(problems) >= limit:
            break
        if not isinstance(key, str):
            problems.append(f"prefix_dict key {short_repr(key)} is not a string")
        else:
            for part in key.split(sep):
                problem = _key_part_problem(part, vocab_size)
                if problem:
                    problems.append(f"prefix_dict key {quote_key(key)!r}: part {short_repr(part)} {problem}")
        if not isinstance(cands, (list, tuple)):
            problems.append(f"prefix_dict key {quote_key(key)!r}: candidates must be a list of token ids, got {type(cands).__name__}")
            continue
        for cand in cands:
            problem = token_problem(cand, vocab_size)
            if problem:
                problems.append(f"prefix_dict key {quote_key(key)!r}: candidate {short_repr(cand)} {problem}")
    return problems[:limit] if limit is not None else problems


def parse_prefix_dict(obj: Any, vocab_size: int | None = None) -> PrefixDictSpec:
    """Validate and flatten a parsed prefix-dict config; ValueError names the first bad key/token."""
    check_vocab_size(vocab_size)
    start, end, sep, prefix_dict = _prefix_dict_header(obj, vocab_size)
    keys = list(prefix_dict.keys())
    parts = _parse_keys_fast(keys, sep, vocab_size)
    cands = flatten_token_lists(list(prefix_dict.values()), vocab_size)
    if parts is None or cands is None:
        _raise_problems(prefix_dict_problems(obj, vocab_size, limit=_PROBLEM_LIMIT), "prefix dict")
    return PrefixDictSpec(start, end, sep, keys, parts[0], parts[1], cands[0], cands[1])


def _parse_keys_fast(keys: list, sep: str, vocab_size: int | None) -> tuple[np.ndarray, np.ndarray] | None:
    """Vectorised parse of every key into token ids; None when any key is not canonical
    (the slow path then names it)."""
    n = len(keys)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(1, np.int64)
    try:
        text = _KEY_DELIM.join(keys)
    except TypeError:  # a non-string key
        return None
    if _PART_DELIM in text or text.count(_KEY_DELIM) != n - 1:
        return None
    try:
        raw = text.replace(sep, _PART_DELIM).encode("ascii")
    except UnicodeEncodeError:
        return None
    b = np.frombuffer(raw, np.uint8)
    is_delim = b <= 1
    if not b.size or is_delim[0] or is_delim[-1] or not np.all(is_delim | ((b - np.uint8(48)) < 10)):
        return None  # an empty part at either end, or a byte that is neither digit nor delimiter
    delims = np.flatnonzero(is_delim)
    starts = np.empty(len(delims) + 1, np.int64)
    starts[0] = 0
    starts[1:] = delims + 1
    lens = np.diff(np.append(starts, len(b) + 1)) - 1
    if lens.min() == 0 or lens.max() > _MAX_DIGITS or np.any((b[starts] == 48) & (lens > 1)):
        return None
    # Every part is now 1-10 plain digits: numpy's C text parser reads them all at once.
    values = np.fromstring(raw.translate(_DELIMS_TO_SPACES), dtype=np.int64, sep=" ")
    if len(values) != len(starts) or values.max() > INT32_MAX or (vocab_size is not None and values.max() >= vocab_size):
        return None
    # Key i's parts start at the span after its preceding key delimiter.
    offsets = np.empty(n + 1, np.int64)
    offsets[0] = 0
    offsets[1:-1] = np.searchsorted(delims, np.flatnonzero(b == 0)) + 1
    offsets[-1] = len(starts)
    return values, offsets


def flatten_token_lists(lists: list, vocab_size: int | None) -> tuple[np.ndarray, np.ndarray] | None:
    """(flat int64 ids, offsets) of a list of token-id lists, or None if any entry is not a list of
    valid token ids (the caller's slow path names it)."""
    if not set(map(type, lists)) <= {list, tuple}:
        return None
    lens = np.fromiter(map(len, lists), np.int64, count=len(lists))
    offsets = np.zeros(len(lists) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    types = set(map(type, chain.from_iterable(lists)))
    if not all(map(is_integer_type, types)):
        return None
    try:
        flat = np.fromiter(chain.from_iterable(lists), np.int64, count=int(offsets[-1]))
    except OverflowError:
        return None
    if flat.size and (flat.min() < 0 or flat.max() > INT32_MAX or (vocab_size is not None and flat.max() >= vocab_size)):
        return None
    return flat, offsets


# ---------------------------------------------------------------------------------------------
# token sequences, token-trie payloads, strings


def _describe_sequence(i: int, names: Sequence[str] | None) -> str:
    return f"sequence {i}" + (f" (leaf {quote_key(names[i])!r})" if names is not None else "")


def sequence_problems(
    sequences: Sequence[Any],
    end_token_id: int,
    vocab_size: int | None = None,
    names: Sequence[str] | None = None,
    limit: int | None = None,
) -> list[str]:
    """Every problem of a list of token sequences (up to `limit`), naming the sequence and token."""
    problems: list[str] = []
    for i, seq in enumerate(sequences):
        if limit is not None and len(problems) >= limit:
            break
        where = _describe_sequence(i, names)
        if not isinstance(seq, (list, tuple)):
            problems.append(f"{where} must be a list of token ids, got {type(seq).__name__}")
            continue
        for pos, tok in enumerate(seq):
            problem = token_problem(tok, vocab_size)
            if problem:
                problems.append(f"{where}: token {short_repr(tok)} at position {pos} {problem}")
            elif tok == end_token_id:
                problems.append(
                    f"{where}: token {tok} at position {pos} is the end token; a sequence ends there implicitly"
                )
    return problems[:limit] if limit is not None else problems


def _as_list(seq: Any) -> Any:
    # Tensors and arrays become lists so that every sequence goes through the same checks.
    tolist = getattr(seq, "tolist", None)
    return tolist() if callable(tolist) and not isinstance(seq, (list, tuple)) else seq


def parse_sequences(
    sequences: Iterable[Any],
    end_token_id: int,
    vocab_size: int | None = None,
    names: Sequence[str] | None = None,
    what: str = "sequences",
) -> SequenceSpec:
    """Validate and flatten token sequences; ValueError names the first bad sequence/token."""
    check_vocab_size(vocab_size)
    end = check_token_id(end_token_id, "end_token_id", vocab_size)
    if isinstance(sequences, (str, bytes, dict)):
        raise ValueError(f"{what} must be a list of token-id lists, got {type(sequences).__name__}")
    seqs = [_as_list(s) for s in sequences]
    if not seqs:
        raise ValueError(f"{what}: no sequences given (the tree would be empty)")
    flat = flatten_token_lists(seqs, vocab_size)
    if flat is None or np.any(flat[0] == end):
        _raise_problems(sequence_problems(seqs, end, vocab_size, names, limit=_PROBLEM_LIMIT), what)
    return SequenceSpec(flat[0], flat[1], list(names) if names is not None else None)


def token_trie_descriptors(obj: Any) -> list[dict]:
    """The descriptors of a parsed TokenTreePayload, checked: a JSON object whose `modelId` is a
    string (or absent) and whose `descriptors` is a non-empty list of objects, each with a `leaves`
    list and a string `path` (or none). ValueError names the descriptor index and the key."""
    if not isinstance(obj, dict):
        raise ValueError(f"token trie payload must be a JSON object, got {type(obj).__name__}")
    model = obj.get("modelId")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"token trie payload key 'modelId' must be a string, got {type(model).__name__}")
    descriptors = obj.get("descriptors")
    if not isinstance(descriptors, list):
        raise ValueError("token trie payload needs a 'descriptors' list")
    if not descriptors:
        raise ValueError("token trie payload has no descriptors (empty leaf set)")
    for i, desc in enumerate(descriptors):
        if not isinstance(desc, dict) or not isinstance(desc.get("leaves"), list):
            raise ValueError(f"descriptor {i} must be an object with a 'leaves' list")
        path = desc.get("path")
        if path is not None and not isinstance(path, str):
            raise ValueError(f"descriptor {i} key 'path' must be a string, got {type(path).__name__} {short_repr(path)}")
    return descriptors


def parse_token_trie(
    payload: Any, *, path: str | None = None, model_id: str | None = None, limits: TreeLimits | None = None
) -> TokenTriePayload:
    """Pick the descriptor of a TokenTreePayload ({modelId, descriptors: [{path, leaves: [{name,
    tokens}]}]}): the one whose `path` matches, or the only one. Leaves of several descriptors with
    the same path are merged. `limits` bounds the payload's JSON text (read_json_source)."""
    obj, _ = load_json(payload, "token trie payload", limits)
    descriptors = token_trie_descriptors(obj)
    payload_model = obj.get("modelId")
    if model_id is not None and payload_model != model_id:
        raise ValueError(f"token trie payload is for model {quote_key(payload_model)!r}, not {quote_key(model_id)!r}")
    paths = [desc.get("path") for desc in descriptors]
    if path is None:
        if len(descriptors) > 1:
            raise ValueError(
                f"token trie payload has {len(descriptors)} descriptors {quote_list(paths)}; choose one with path="
            )
        chosen = descriptors
    else:
        chosen = [desc for desc in descriptors if desc.get("path") == path]
        if not chosen:
            raise ValueError(f"token trie payload has no descriptor with path {quote_key(path)!r}; paths: {quote_list(paths)}")
    chosen_path = chosen[0].get("path")
    label = repr(chosen_path if chosen_path is None else quote_key(chosen_path))
    leaves = [leaf for desc in chosen for leaf in desc["leaves"]]
    if not leaves:
        raise ValueError(f"descriptor {label} has no leaves (empty leaf set)")
    names, sequences = [], []
    for j, leaf in enumerate(leaves):
        if not isinstance(leaf, dict) or "tokens" not in leaf:
            raise ValueError(f"descriptor {label} leaf {j} must be an object with 'tokens'")
        name = leaf.get("name", f"#{j}")
        names.append(name if isinstance(name, str) else short_repr(name))
        sequences.append(leaf["tokens"])
    return TokenTriePayload(payload_model, chosen[0].get("path"), names, sequences)


def _special_token_encoder(tokenizer: Any) -> tuple[Callable[[str], Any], dict[int, str]] | None:
    """For a Hugging Face tokenizer (transformers', or a `tokenizers.Tokenizer`): an encoder that adds
    no special tokens, and the special ids with their text. Calling such a tokenizer adds them:
    Llama-2's BOS would become the only token the tree's root allows. None for any other callable."""
    encode = getattr(tokenizer, "encode", None)
    if not callable(encode):
        return None
    if hasattr(tokenizer, "all_special_ids"):  # transformers
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special = {int(i): str(t) for i, t in added.items() if getattr(t, "special", False)}
        for i in tokenizer.all_special_ids:
            special.setdefault(int(i), str(tokenizer.convert_ids_to_tokens(int(i))))
        return (lambda s: encode(s, add_special_tokens=False)), special
    if type(tokenizer).__module__.partition(".")[0] == "tokenizers":  # tokenizers.Tokenizer
        added = tokenizer.get_added_tokens_decoder()
        special = {int(i): t.content for i, t in added.items() if t.special}
        return (lambda s: encode(s, add_special_tokens=False).ids), special
    return None


def tokenize_strings(strings: Iterable[str], tokenizer: Callable[[str], Any]) -> tuple[list[Any], list[str]]:
    """(token sequences, names): `tokenizer(s)` may return a list of ids, a 1-D tensor/array, or a
    mapping / encoding with `input_ids`. A Hugging Face tokenizer is asked for no special tokens, and
    a string that still tokenizes to one (a tokenizer that always adds BOS, or a special token's text
    inside the string) is an error naming the string and the token."""
    hf = _special_token_encoder(tokenizer)
    if hf is not None:
        tokenizer, special = hf
    names, sequences = [], []
    for s in strings:
        if not isinstance(s, str):
            raise ValueError(f"strings must be str, got {type(s).__name__} ({s!r})")
        ids = tokenizer(s)
        if hf is not None:
            for position, token in enumerate(_as_list(ids)):
                if int(token) in special:
                    raise ValueError(
                        f"string {s!r} tokenizes to the special token {special[int(token)]!r} (id {token}) at "
                        f"position {position} even without special tokens; a tree of strings must hold only "
                        f"their text's tokens (pass a callable that returns exactly the ids to allow)"
                    )
        if not isinstance(ids, (list, tuple)) and "input_ids" in getattr(ids, "keys", lambda: ())():
            ids = ids["input_ids"]
        names.append(s)
        sequences.append(_as_list(ids))
    return sequences, names
