"""How logitgate changes vLLM: install / uninstall the rows of a patch table (the table: patches.py).

A row (`Patch`) names one vLLM attribute by its dotted owner (`module` or `module:Class`) and says
why logitgate uses it, until when (the vLLM version or upstream change that retires it) and
whether start-up must stop without it (`required`) or may warn and leave vLLM's own in place.
Its `use` says how (as llama_cpp/private_reads.py's rows do):

- "replace": `replacement` is "module:factory" inside this package; `factory(original,
  dotted_name)` returns what is put in vLLM's place, marked by `mark_replacement`: installed,
  counted (`routed_calls`) and reversible;
- "write": an attribute logitgate writes on vLLM's objects at run time (vLLM's own, or
  logitgate's bookkeeping kept there: `vllm_attr=False`);
- "read" / "call": a private member of vLLM's that logitgate reads or calls;
- "name": a vLLM class that logitgate's code recognises by its name or module (the owner is the
  module, `attr` the class).

Nothing is installed for the last four (`used_by` says which logitgate code uses the name):
`install` resolves each against the running vLLM (`check_present`), so a vLLM upgrade that renames
or drops one is caught at start-up, naming the row, as loudly as its `required` says; the table
tests check every row against both pinned vLLMs.

`install(targets, selected)` takes the table as an argument (the table imports nothing from here
but `Patch`, and this module imports no replacement body), resolves each row of a selected
operation, and is idempotent. Names are patched where vLLM looks them up: `from x import f`
copies a reference, so each importing module has a row of its own. Nothing here imports torch,
numba or a replacement module before `install` resolves a row.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["ALWAYS", "FIX", "USES", "Patch", "PatchError", "check_present", "has_attribute", "install", "installed",
           "mark_replacement", "owner_of", "uninstall"]

logger = logging.getLogger("vllm.logitgate.patching")

FIX = "fix"  # corrections of vLLM bugs (and the worker's start-up loads) that logitgate's guarantees depend on: installed with any kernel operation
ALWAYS = "always"  # installed in every process the plugin loads in, whatever LOGITGATE_VLLM_OPS selects
USES = ("replace", "write", "read", "call", "name")  # how a row uses its vLLM name (module docstring)


class PatchError(RuntimeError):
    """A required row could not be resolved against the running vLLM: start-up stops here."""


@dataclass(frozen=True)
class Patch:
    """One row of the patch table (see the module docstring)."""

    op: str  # the LOGITGATE_VLLM_OPS name that selects it, FIX or ALWAYS
    owner_path: str  # "module" or "module:Class"
    attr: str
    why: str
    until: str
    required: bool
    replacement: str | None = None  # "module:factory" relative to this package; None for every other use
    used_by: str = ""  # rows other than replacements: the logitgate code that writes, reads or calls it
    vllm_attr: bool = True  # write rows: vLLM's own attribute (False: logitgate's own, kept on vLLM's object)
    optional_package: str | None = None  # skip quietly when this package is not installed (vllm-ascend)
    only_if_loaded: bool = False  # skip quietly when the module is not imported (front-end-only classes)
    use: str = ""  # one of USES; "" means "replace" with a replacement, "write" without

    def __post_init__(self) -> None:
        if not self.use:
            object.__setattr__(self, "use", "write" if self.replacement is None else "replace")
        if self.use not in USES or (self.use == "replace") != (self.replacement is not None):
            raise ValueError(f"row {self.name}: use {self.use!r} with replacement {self.replacement!r}")

    @property
    def name(self) -> str:
        return f"{self.owner_path.replace(':', '.')}.{self.attr}"

    @property
    def module_name(self) -> str:
        return self.owner_path.partition(":")[0]

    @property
    def replaces(self) -> bool:
        return self.use == "replace"

    @property
    def is_write(self) -> bool:
        return self.use == "write"


def mark_replacement(replacement: Callable, original: Callable, name: str) -> Callable:
    """Record what a replacement stands in for (install() uses it to stay idempotent) and count its
    routed calls (tests and the benchmark check that the engine really used logitgate)."""
    replacement.__logitgate_original__ = original
    replacement.__logitgate_name__ = name
    replacement.routed_calls = 0
    return replacement


def is_replacement(value: Any) -> bool:
    """Whether `value` is one of logitgate's replacements (mark_replacement): the one way every
    module asks, rather than reading the markers itself."""
    return _original_of(value) is not None


def unwrapped(value: Any) -> Any:
    """The original a replacement stands in for; anything else is returned as it is."""
    original = _original_of(value)
    return value if original is None else original


def _original_of(value: Any) -> Any:
    """The original a replacement stands in for, None for anything else. Read from the instance
    dict: vLLM's lazy module proxies import their module on any other attribute access."""
    namespace = getattr(value, "__dict__", None)
    return namespace.get("__logitgate_original__") if isinstance(namespace, dict) else None


def owner_of(row: Patch) -> Any:
    """The object holding the row's attribute (its module, or a class in it); imports the module."""
    module_name, _, class_name = row.owner_path.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name) if class_name else module


def _assigned_in_source(cls: type, attr: str) -> bool | None:
    """Whether some class of `cls`'s MRO assigns `self.<attr>` in its source; None when no source
    can be read (then nothing can be said)."""
    pattern = re.compile(rf"\bself\.{re.escape(attr)}\s*(?::[^=\n]+)?=(?!=)")
    sources = [source for source in map(_source, cls.__mro__[:-1]) if source is not None]
    if not sources:
        return None
    return any(pattern.search(source) for source in sources)


@functools.lru_cache(maxsize=None)
def _source(klass: type) -> str | None:
    try:
        return inspect.getsource(klass)
    except (OSError, TypeError):
        return None


def has_attribute(owner: Any, attr: str) -> bool:
    """Whether vLLM's `owner` has `attr`: a class or module attribute, a dataclass or msgspec
    field, an annotation, or (instance attributes) a `self.<attr> =` in a class's source."""
    if hasattr(owner, attr) or attr in getattr(owner, "__dataclass_fields__", ()) or attr in getattr(owner, "__struct_fields__", ()):
        return True
    if not isinstance(owner, type):
        return False
    if any(attr in getattr(klass, "__annotations__", {}) for klass in owner.__mro__):
        return True
    return _assigned_in_source(owner, attr) is not False


def check_present(row: Patch, owner: Any) -> None:
    """AttributeError naming what is missing where vLLM's `owner` no longer has what a row other
    than a replacement uses: the attribute (a write of vLLM's own, a read), a callable (a call),
    a class of that name (a name); for logitgate's own attributes, only the owner class."""
    where = f"{row.owner_path} has no"
    if row.use == "write" and not row.vllm_attr:
        if not isinstance(owner, type):
            raise AttributeError(f"{row.owner_path} is not a class")
    elif row.use in ("write", "read"):
        if not has_attribute(owner, row.attr):
            raise AttributeError(f"{where} attribute {row.attr!r}")
    elif row.use == "call":
        if not callable(getattr(owner, row.attr, None)):
            raise AttributeError(f"{where} callable {row.attr!r}")
    elif row.use == "name":
        if not isinstance(getattr(owner, row.attr, None), type):
            raise AttributeError(f"{where} class {row.attr!r}")


def _factory(row: Patch) -> Callable[[Any, str], Any]:
    module, _, function = row.replacement.partition(":")
    return getattr(importlib.import_module(module, __package__), function)


def _skipped(row: Patch) -> bool:
    if row.optional_package and importlib.util.find_spec(row.optional_package) is None:
        return True
    return row.only_if_loaded and row.module_name not in sys.modules


_VERBS = {"replace": "patch", "write": "write", "read": "read", "call": "call", "name": "recognise"}


def _unresolved(row: Patch, exc: BaseException) -> None:
    """Abort start-up for a required row, warn for the others (vLLM's own stays in use)."""
    what = f"{row.name} ({type(exc).__name__}: {exc})"
    if row.required:
        verb = _VERBS[row.use]
        raise PatchError(f"logitgate cannot {verb} {what}, which it requires: {row.why} (until: {row.until})") from exc
    if not row.replaces:
        logger.warning("logitgate: vLLM has no %s; the code that uses it (%s: %s) falls back", what, row.use,
                       row.used_by)
    else:
        logger.warning("logitgate: cannot replace %s; vLLM's own stays in use", what)


_saved: dict[str, tuple[Any, str, bool, Any]] = {}  # dotted name -> (owner, attr, owned by the owner itself, raw value)


def install(targets: Iterable[Patch], selected: Iterable[str]) -> list[str]:
    """Install the replacement rows of `targets` whose `op` is in `selected` and check its other
    rows (`check_present`); returns the dotted names now routed to logitgate (already replaced ones included, so a
    second call changes nothing and returns the same list). A row vLLM lacks aborts start-up with
    PatchError when `required`, else is reported in a warning and left alone."""
    chosen = set(selected)
    replaced = []
    for row in targets:
        if row.op not in chosen or _skipped(row):
            continue
        try:
            owner = owner_of(row)
            if not row.replaces:
                check_present(row, owner)
                continue
            current = getattr(owner, row.attr)
        except Exception as exc:  # noqa: BLE001 - another vLLM version, or vllm-ascend without its NPU stack
            _unresolved(row, exc)
            continue
        if _original_of(current) is None:
            own = row.attr in getattr(owner, "__dict__", {})
            raw = owner.__dict__[row.attr] if own else None
            replacement = _factory(row)(current, row.name)
            if isinstance(raw, (staticmethod, classmethod)):
                replacement = type(raw)(replacement)
            _saved[row.name] = (owner, row.attr, own, raw)
            setattr(owner, row.attr, replacement)
        replaced.append(row.name)
    return replaced


def installed(targets: Iterable[Patch]) -> dict[str, Any]:
    """Dotted name -> the replacement in place (with its `routed_calls` counter), for every
    replacement row whose module is loaded."""
    found = {}
    for row in targets:
        if not row.replaces or row.module_name not in sys.modules:
            continue
        try:
            owner = owner_of(row)
        except Exception:  # noqa: BLE001 - a class this vLLM lacks holds no replacement
            continue
        value = getattr(owner, row.attr, None)
        if _original_of(value) is not None:
            found[row.name] = value
    return found


def uninstall(targets: Iterable[Patch]) -> list[str]:
    """Put vLLM's originals back exactly as they were (the same object, or no attribute of the
    owner's own where it was inherited); the dotted names restored."""
    restored = []
    rows = {row.name: row for row in targets}
    for name, value in installed(rows.values()).items():
        saved = _saved.pop(name, None)
        if saved is None:  # replaced by an earlier copy of this module: the original rides on the replacement
            saved = (owner_of(rows[name]), rows[name].attr, True, _original_of(value))
        owner, attr, own, raw = saved
        if own:
            setattr(owner, attr, raw)
        else:
            delattr(owner, attr)
        restored.append(name)
    return restored
