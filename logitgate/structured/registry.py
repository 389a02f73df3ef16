"""Grammar-backend registry: name -> factory.

Built-in engines live in `*_backend.py` modules of `logitgate/structured/` or of a subpackage
(`tree/grammar_backend.py`) and register themselves when imported; the registry imports those
modules on first lookup, so adding an engine is adding one such file (define the backend class,
call `register_grammar_backend`). Code outside the package calls
`register_grammar_backend` itself before creating a manager.

A factory is called as `factory(tokenizer_info=..., vocab_size=...)` and returns a GrammarBackend.
"""
from __future__ import annotations

import importlib
import logging
import pkgutil
import threading
from collections.abc import Callable
from pathlib import Path

from .grammar import GrammarBackend

logger = logging.getLogger(__name__)

__all__ = ["available_grammar_backends", "get_grammar_backend_factory", "register_grammar_backend"]

BackendFactory = Callable[..., GrammarBackend]

_FACTORIES: dict[str, BackendFactory] = {}
_IMPORT_ERRORS: dict[str, str] = {}  # module name -> why it did not import (e.g. xgrammar missing)
_discovered = False
_lock = threading.Lock()
_discover_lock = threading.Lock()  # separate: modules call register_grammar_backend while imported


def register_grammar_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Make `factory` available as grammar backend `name`."""
    if not name or not isinstance(name, str):
        raise ValueError(f"a grammar backend name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise ValueError(f"the factory for grammar backend {name!r} is not callable")
    with _lock:
        if name in _FACTORIES and _FACTORIES[name] is not factory and not replace:
            raise ValueError(f"grammar backend {name!r} is already registered (pass replace=True to override)")
        _FACTORIES[name] = factory


def _discover() -> None:
    """Import every `*_backend` module once; each registers its engine."""
    global _discovered
    if _discovered:
        return
    with _discover_lock:
        if _discovered:
            return
        for name in _backend_modules():
            try:
                importlib.import_module(f"{__package__}.{name}")
            except Exception as exc:  # noqa: BLE001 - one broken engine must not hide the others
                _IMPORT_ERRORS[name] = f"{type(exc).__name__}: {exc}"
                logger.warning("grammar backend module %s did not import: %s", name, exc)
        _discovered = True


def _backend_modules() -> list[str]:
    """The `*_backend` modules of this package and of its subpackages (tree/grammar_backend.py),
    relative to this package; found without importing anything."""
    here = Path(__file__).parent
    names = []
    for module in pkgutil.iter_modules([str(here)]):
        if module.ispkg:
            names += [f"{module.name}.{m.name}" for m in pkgutil.iter_modules([str(here / module.name)]) if m.name.endswith("_backend")]
        elif module.name.endswith("_backend"):
            names.append(module.name)
    return names


def available_grammar_backends() -> list[str]:
    """Names of the registered grammar backends, sorted."""
    _discover()
    return sorted(_FACTORIES)


def get_grammar_backend_factory(name: str) -> BackendFactory:
    """The factory registered as `name` (ValueError naming the known ones otherwise)."""
    _discover()
    try:
        return _FACTORIES[name]
    except KeyError:
        why = f"; modules that failed to import: {_IMPORT_ERRORS}" if _IMPORT_ERRORS else ""
        raise ValueError(
            f"unknown grammar backend {name!r}; registered: {', '.join(sorted(_FACTORIES)) or 'none'}{why}"
        ) from None
