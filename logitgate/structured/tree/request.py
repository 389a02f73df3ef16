"""A request's tree as its `extra_args` name it: the request format every route shares (the
logits processors, the vLLM structured-output route, the vLLM front end's admission).

extra_args keys (all optional; a request with neither tree key has no tree):
- "tree_decode": an RTP-LLM prefix-dict config (dict, JSON string or path), as `TreeDFA.from_prefix_dict`;
- "token_trie": a TokenTreePayload (dict, JSON string or path), as `TreeDFA.from_token_trie`, with
  "end_token_id" (default: the caller's `eos_token_id`), "token_trie_path" (the descriptor) and
  "token_trie_model_id" (reject a payload built for another model).

`tree_request(params)` checks the arguments' shape (a `TreeRequest`, nothing read or compiled);
`TreeRequest.compile` builds the TreeDFA through the loaders' process-wide compile cache.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from .dfa import TreeDFA
from .loaders import check_token_id

__all__ = ["TREE_ARG_KEYS", "TreeRequest", "tree_request"]

TREE_DECODE, TOKEN_TRIE, END_TOKEN_ID = "tree_decode", "token_trie", "end_token_id"
TRIE_PATH, TRIE_MODEL_ID = "token_trie_path", "token_trie_model_id"
TREE_ARG_KEYS = (TREE_DECODE, TOKEN_TRIE, END_TOKEN_ID, TRIE_PATH, TRIE_MODEL_ID)
_TRIE_ONLY = (END_TOKEN_ID, TRIE_PATH, TRIE_MODEL_ID)
_SOURCE_TYPES = (dict, str, bytes, os.PathLike)


class TreeRequest(NamedTuple):
    """A request's tree, as named by its extra_args (checked for shape, not yet compiled)."""

    kind: str  # "tree_decode" or "token_trie"
    source: Any
    end_token_id: int | None = None
    path: str | None = None
    model_id: str | None = None

    def end_token(self, vocab_size: int | None, eos_token_id: int | None = None) -> int | None:
        """A token trie's end token (its own, else `eos_token_id`), checked; None for a prefix dict
        (its config names it)."""
        if self.kind != TOKEN_TRIE:
            return None
        end = self.end_token_id if self.end_token_id is not None else eos_token_id
        if end is None:
            raise ValueError(f"extra_args[{TOKEN_TRIE!r}] needs extra_args[{END_TOKEN_ID!r}]: the token that ends an item")
        return check_token_id(end, f"extra_args[{END_TOKEN_ID!r}]" if self.end_token_id is not None else "eos_token_id", vocab_size)

    def compile(self, vocab_size: int | None, device: Any = "cpu", eos_token_id: int | None = None) -> TreeDFA:
        """The compiled (cached) TreeDFA; ValueError names the extra_args key at fault."""
        end = self.end_token(vocab_size, eos_token_id)
        try:
            if self.kind == TREE_DECODE:
                return TreeDFA.from_prefix_dict(self.source, vocab_size=vocab_size, device=device)
            return TreeDFA.from_token_trie(
                self.source, end_token_id=end, path=self.path, model_id=self.model_id, vocab_size=vocab_size, device=device
            )
        except ValueError as err:
            raise ValueError(f"extra_args[{self.kind!r}]: {err}") from None


def tree_request(params: Any) -> TreeRequest | None:
    """The tree a request asks for in `params.extra_args` (logitgate's or vLLM's SamplingParams),
    or None. ValueError for malformed arguments (both tree kinds, a wrong type, a trie option
    without a trie)."""
    args = getattr(params, "extra_args", None)
    if args is None:
        return None
    if not isinstance(args, Mapping):
        raise ValueError(f"extra_args must be a dict, got {type(args).__name__}")
    given = [key for key in (TREE_DECODE, TOKEN_TRIE) if args.get(key) is not None]
    if not given:
        stray = [key for key in _TRIE_ONLY if args.get(key) is not None]
        if stray:
            raise ValueError(f"extra_args[{stray[0]!r}] applies to {TOKEN_TRIE!r}, which is not given")
        return None
    if len(given) > 1:
        raise ValueError(f"extra_args has both {TREE_DECODE!r} and {TOKEN_TRIE!r}; a request decodes under one tree")
    kind = given[0]
    source = args[kind]
    if not isinstance(source, _SOURCE_TYPES):
        raise ValueError(f"extra_args[{kind!r}] must be a dict, a JSON string or a path, got {type(source).__name__}")
    if kind == TREE_DECODE:
        stray = [key for key in _TRIE_ONLY if args.get(key) is not None]
        if stray:
            raise ValueError(f"extra_args[{stray[0]!r}] applies to {TOKEN_TRIE!r}, not to {TREE_DECODE!r}")
        return TreeRequest(kind, source)
    end = args.get(END_TOKEN_ID)
    if end is not None:
        end = check_token_id(end, f"extra_args[{END_TOKEN_ID!r}]", None)
    for key in (TRIE_PATH, TRIE_MODEL_ID):
        if args.get(key) is not None and not isinstance(args[key], str):
            raise ValueError(f"extra_args[{key!r}] must be a string, got {type(args[key]).__name__}")
    return TreeRequest(kind, source, end, args.get(TRIE_PATH), args.get(TRIE_MODEL_ID))
