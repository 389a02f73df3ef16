"""A bounded, thread-safe LRU cache for compiled constraints, keyed by a content hash, so the same
tree (or grammar) is compiled once per process however often a request brings it."""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np

V = TypeVar("V")


def content_hash(*parts: Any) -> str:
    """A hex digest over `parts`: bytes, str, numpy arrays (dtype, shape and data), None, ints, or
    tuples of those. Equal content gives equal digests; the part boundaries are part of the hash."""
    h = hashlib.blake2b(digest_size=20)
    for part in parts:
        _update(h, part)
    return h.hexdigest()


def _update(h, part: Any) -> None:
    if isinstance(part, np.ndarray):
        arr = np.ascontiguousarray(part)
        h.update(f"nd:{arr.dtype.str}:{arr.shape}:".encode())
        h.update(arr.view(np.uint8).reshape(-1).data)
    elif isinstance(part, (bytes, bytearray, memoryview)):
        h.update(f"b:{len(part)}:".encode())
        h.update(part)
    elif isinstance(part, str):
        data = part.encode("utf-8", "surrogatepass")
        h.update(f"s:{len(data)}:".encode())
        h.update(data)
    elif isinstance(part, tuple):
        h.update(f"t:{len(part)}:".encode())
        for item in part:
            _update(h, item)
    elif part is None or isinstance(part, (bool, int, float)):
        h.update(f"v:{part!r};".encode())
    else:
        raise TypeError(f"cannot hash {type(part).__name__}")


class LRUCache(Generic[V]):
    """At most `maxsize` entries and, with `sizeof`, at most `max_bytes` bytes of them (the sum of
    sizeof(value) over the entries); the least recently used entries are dropped first. A value
    larger than `max_bytes` on its own is returned but not kept. 0 for either bound keeps nothing."""

    def __init__(self, maxsize: int = 32, *, max_bytes: int | None = None, sizeof: Callable[[V], int] | None = None) -> None:
        if maxsize < 0:
            raise ValueError(f"maxsize must be >= 0, got {maxsize}")
        if max_bytes is not None and (max_bytes < 0 or sizeof is None):
            raise ValueError(f"max_bytes must be >= 0 and needs sizeof, got {max_bytes}")
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self._sizeof = sizeof
        self._data: OrderedDict[Any, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get_or_create(self, key: Any, create: Callable[[], V]) -> V:
        """The cached value for `key`, else `create()` (outside the lock, so a slow compile does not
        block lookups of other keys), stored and returned."""
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                self.hits += 1
                return self._data[key][0]
            self.misses += 1
        value = create()
        size = int(self._sizeof(value)) if self._sizeof is not None else 0
        with self._lock:
            if key in self._data:  # two threads compiled the same key at once: keep the first result
                self._data.move_to_end(key)
                return self._data[key][0]
            if self.maxsize and (self.max_bytes is None or size <= self.max_bytes):
                self._data[key] = (value, size)
                self._bytes += size
                while len(self._data) > self.maxsize or (self.max_bytes is not None and self._bytes > self.max_bytes):
                    self._bytes -= self._data.popitem(last=False)[1][1]
        return value

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0
            self.hits = self.misses = 0

    def info(self) -> dict[str, int | None]:
        with self._lock:
            return {
                "size": len(self._data), "maxsize": self.maxsize, "bytes": self._bytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses,
            }

    def __len__(self) -> int:
        return len(self._data)
