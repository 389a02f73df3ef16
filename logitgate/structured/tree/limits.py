"""Operator limits on token trees, and the memory bound of their compile cache.

A tree comes from a client (a vLLM request) as often as from a file, so its size is the operator's
policy. Each limit is checked before the work it protects: the JSON text's size before parsing,
the node count and the depth (longest sequence / key) before the trie is built. Nodes are counted
from the parsed tree (loaders.TreeSize: the root and a node per token of a sequence, or per
key of a prefix dict), never fewer than the compiled tree has, the same way wherever a tree is
checked (the vLLM front end and the compile). Beyond a limit, `TreeTooLarge` (a ValueError: an HTTP 400
in the vLLM plugin) names the limit, the value and the variable that sets it.

    LOGITGATE_TREE_MAX_BYTES    JSON text of one tree (file, str or bytes)   default 128 MiB
    LOGITGATE_TREE_MAX_NODES    trie nodes of one tree (root included)        default 16777216
    LOGITGATE_TREE_MAX_DEPTH    tokens along one path (sequence, key)         default 65536
    LOGITGATE_TREE_CACHE_BYTES  bytes of compiled trees kept for reuse        default 256 MiB
                                per process (host and device arrays, dense bitmask rows included)

Values are integers (bytes for the byte settings); the environment is read when a tree is built
(limits) or when the cache is first used (cache bound). `check_environment()` reads them all, so a
server can fail at start-up on a malformed value instead of on its first request.

Import-light (the standard library only): vLLM's plugin and front end may import it at start-up.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ... import envs

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_NODES",
    "ENV_CACHE_BYTES",
    "ENV_MAX_BYTES",
    "ENV_MAX_DEPTH",
    "ENV_MAX_NODES",
    "TreeLimits",
    "TreeTooLarge",
    "cache_bytes_from_env",
    "check_environment",
]

ENV_MAX_BYTES = "LOGITGATE_TREE_MAX_BYTES"
ENV_MAX_NODES = "LOGITGATE_TREE_MAX_NODES"
ENV_MAX_DEPTH = "LOGITGATE_TREE_MAX_DEPTH"
ENV_CACHE_BYTES = "LOGITGATE_TREE_CACHE_BYTES"
DEFAULT_MAX_BYTES = 128 << 20  # a 1M-key prefix dict is ~40 MB of JSON
DEFAULT_MAX_NODES = 1 << 24  # ~50 bytes a node compiled: ~800 MB at the limit
DEFAULT_MAX_DEPTH = 1 << 16  # longer than any model's useful output under a tree
DEFAULT_CACHE_BYTES = 256 << 20


class TreeTooLarge(ValueError):
    """A tree beyond an operator limit. `limit` is "bytes", "nodes" or "depth"; `value` the tree's
    size, `maximum` the limit in force, `env_var` the variable that sets it."""

    _WORDS = {"bytes": ("size", " bytes"), "nodes": ("node count", " nodes"), "depth": ("depth", " tokens")}

    def __init__(self, limit: str, value: int, maximum: int, env_var: str, what: str = "tree") -> None:
        self.limit, self.value, self.maximum, self.env_var = limit, value, maximum, env_var
        name, unit = self._WORDS[limit]
        super().__init__(
            f"{what} is too large: its {name} is {value}{unit}, over the limit of {maximum}{unit} "
            f"(the operator's setting {env_var})"
        )


def _env_int(name: str, default: int, environ: Mapping[str, str] | None, minimum: int) -> int:
    text = envs.read(name, environ)
    if text is None or not text.strip():
        return default
    try:
        value = int(text.strip().replace("_", ""))
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={text!r} must be at least {minimum}")
    return value


@dataclass(frozen=True)
class TreeLimits:
    """The size limits one tree is built under (see the module docstring)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_nodes: int = DEFAULT_MAX_NODES
    max_depth: int = DEFAULT_MAX_DEPTH

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TreeLimits:
        """The limits set by LOGITGATE_TREE_MAX_{BYTES,NODES,DEPTH} (defaults where unset);
        ValueError naming the variable for a value that is not a positive integer."""
        return cls(
            _env_int(ENV_MAX_BYTES, DEFAULT_MAX_BYTES, environ, 1),
            _env_int(ENV_MAX_NODES, DEFAULT_MAX_NODES, environ, 1),
            _env_int(ENV_MAX_DEPTH, DEFAULT_MAX_DEPTH, environ, 1),
        )

    def check_bytes(self, size: int, what: str = "tree") -> None:
        if size > self.max_bytes:
            raise TreeTooLarge("bytes", size, self.max_bytes, ENV_MAX_BYTES, what)

    def check_nodes(self, nodes: int, what: str = "tree") -> None:
        if nodes > self.max_nodes:
            raise TreeTooLarge("nodes", nodes, self.max_nodes, ENV_MAX_NODES, what)

    def check_depth(self, depth: int, what: str = "tree") -> None:
        if depth > self.max_depth:
            raise TreeTooLarge("depth", depth, self.max_depth, ENV_MAX_DEPTH, what)

    def read_file(self, path: str | os.PathLike, what: str = "tree") -> bytes:
        """The file's bytes, read no further than one byte past max_bytes (a huge or endless file
        stops there): TreeTooLarge beyond it; OSError as opening or reading raise it."""
        with open(path, "rb") as f:
            raw = f.read(self.max_bytes + 1)
        if len(raw) > self.max_bytes:
            try:
                size = max(os.stat(path).st_size, len(raw))
            except OSError:
                size = len(raw)
            raise TreeTooLarge("bytes", size, self.max_bytes, ENV_MAX_BYTES, what)
        return raw

    def check_size(self, size: tuple[int, int], what: str = "tree") -> None:
        """A tree's (nodes, depth) as counted before its trie is built (loaders.TreeSize):
        the node limit, then the depth limit."""
        nodes, depth = size
        self.check_nodes(nodes, what)
        self.check_depth(depth, what)


def cache_bytes_from_env(environ: Mapping[str, str] | None = None) -> int:
    """LOGITGATE_TREE_CACHE_BYTES, else DEFAULT_CACHE_BYTES (0 keeps no compiled tree)."""
    return _env_int(ENV_CACHE_BYTES, DEFAULT_CACHE_BYTES, environ, 0)


def check_environment(environ: Mapping[str, str] | None = None) -> tuple[TreeLimits, int]:
    """(limits, cache bytes) from the environment; ValueError naming a malformed variable."""
    return TreeLimits.from_env(environ), cache_bytes_from_env(environ)
