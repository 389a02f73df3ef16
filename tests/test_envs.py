"""logitgate/envs.py declares every LOGITGATE_* variable the code reads, the code reads them through
it (at call time), its docstring table is the registry, and `logitgate doctor` shows what is set."""
import ast
import pathlib
import re
import textwrap

import pytest

import logitgate
from logitgate import envs

PACKAGE = pathlib.Path(logitgate.__file__).parent
SCRIPTS = PACKAGE.parent / "scripts"
NAME = re.compile(r"LOGITGATE_[A-Z0-9_]+")
# Modules that may pass a variable (not a literal) to os.environ.get: the demo saves and restores
# LOGITGATE_DEVICE around a run; the doctor prints the device settings whether logitgate's or not.
SAVES_OR_PRINTS = {"cli/demo.py", "cli/doctor.py"}


def _sources():
    yield from PACKAGE.rglob("*.py")
    yield from SCRIPTS.glob("*.py")


def test_every_name_in_the_code_is_declared():
    undeclared = set()
    for path in _sources():
        for name in NAME.findall(path.read_text()):
            if name.endswith("_"):  # LOGITGATE_TREE_MAX_{BYTES,...} / LOGITGATE_TREE_MAX_*: a prefix
                if not any(v.startswith(name) for v in envs.VARIABLES):
                    undeclared.add(f"{path.name}: {name}*")
            elif name not in envs.VARIABLES:
                undeclared.add(f"{path.name}: {name}")
    assert sorted(undeclared) == []


def test_every_declared_name_is_used():
    text = "".join(p.read_text() for p in _sources() if p.name != "envs.py")
    assert [name for name in envs.VARIABLES if name not in text] == []


def test_the_docstring_table_is_the_registry():
    assert textwrap.indent(envs.table(), "    ") in envs.__doc__  # regenerate: python -m logitgate.envs
    assert all(v.name.startswith(envs.PREFIX) and v.type and v.default and v.meaning for v in envs.VARIABLES.values())


def test_the_configuration_page_lists_every_variable():
    page = (PACKAGE.parent / "docs" / "configuration.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in page.splitlines() if line.startswith("| `LOGITGATE_")}
    assert rows == set(envs.VARIABLES)


def test_no_module_reads_a_logitgate_variable_around_envs():
    """os.environ.get / os.getenv / os.environ[...] with a LOGITGATE_ literal, or with a computed
    name outside SAVES_OR_PRINTS, bypasses the registry."""
    bypass = []
    for path in PACKAGE.rglob("*.py"):
        where = str(path.relative_to(PACKAGE))
        if where == "envs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            key = None
            if isinstance(node, ast.Call) and node.args and ast.unparse(node.func) in ("os.environ.get", "os.getenv"):
                key = node.args[0]
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ" and isinstance(node.ctx, ast.Load):
                key = node.slice
            if key is None:
                continue
            literal = isinstance(key, ast.Constant) and isinstance(key.value, str)
            if (literal and key.value.startswith(envs.PREFIX)) or (not literal and where not in SAVES_OR_PRINTS):
                bypass.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    assert bypass == []


def test_read_is_at_call_time_and_refuses_undeclared_names(monkeypatch):
    monkeypatch.delenv("LOGITGATE_VLLM_OPS", raising=False)
    assert envs.read("LOGITGATE_VLLM_OPS") is None
    monkeypatch.setenv("LOGITGATE_VLLM_OPS", "bitmask")
    assert envs.read("LOGITGATE_VLLM_OPS") == "bitmask"
    assert envs.read("LOGITGATE_VLLM_OPS", {"LOGITGATE_VLLM_OPS": "tree"}) == "tree"
    with pytest.raises(KeyError, match="LOGITGATE_VLLM_OP is not a declared"):
        envs.read("LOGITGATE_VLLM_OP")
    monkeypatch.setenv("LOGITGATE_VLLM_OP", "tree")  # a typo of the operator's
    assert envs.set_variables()["LOGITGATE_VLLM_OPS"] == "bitmask"
    assert envs.unknown_variables() == {"LOGITGATE_VLLM_OP": "tree"}


def test_owners_read_through_envs_with_their_own_messages(monkeypatch):
    from logitgate.backends.cpu.threads import safe_thread_count
    from logitgate.structured.tree.candidates import resolve_sparse_max_fraction
    from logitgate.structured.tree.limits import TreeLimits

    monkeypatch.setenv("LOGITGATE_THREADS", "3")
    assert safe_thread_count() == 3
    monkeypatch.setenv("LOGITGATE_THREADS", "zero")
    with pytest.raises(ValueError, match="LOGITGATE_THREADS='zero': expected a positive integer"):
        safe_thread_count()
    monkeypatch.setenv("LOGITGATE_TREE_MAX_DEPTH", "7")
    assert TreeLimits.from_env().max_depth == 7
    assert TreeLimits.from_env({}).max_depth == TreeLimits().max_depth
    with pytest.raises(ValueError, match=r"LOGITGATE_TREE_MAX_NODES='0' must be at least 1"):
        TreeLimits.from_env({"LOGITGATE_TREE_MAX_NODES": "0"})
    monkeypatch.setenv("LOGITGATE_TREE_SPARSE_MAX_FRACTION", "x")
    with pytest.raises(ValueError, match="LOGITGATE_TREE_SPARSE_MAX_FRACTION='x' is not a number"):
        resolve_sparse_max_fraction()


def test_declared_defaults_are_the_owners_defaults():
    from logitgate.structured.tree import candidates, limits

    default = {name: v.default for name, v in envs.VARIABLES.items()}
    assert default["LOGITGATE_TREE_MAX_BYTES"].split()[0] == str(limits.DEFAULT_MAX_BYTES)
    assert default["LOGITGATE_TREE_MAX_NODES"] == str(limits.DEFAULT_MAX_NODES)
    assert default["LOGITGATE_TREE_MAX_DEPTH"] == str(limits.DEFAULT_MAX_DEPTH)
    assert default["LOGITGATE_TREE_CACHE_BYTES"].split()[0] == str(limits.DEFAULT_CACHE_BYTES)
    assert default["LOGITGATE_TREE_SPARSE_MAX_FRACTION"] == str(candidates.DEFAULT_SPARSE_MAX_FRACTION)


def test_doctor_lists_the_set_variables_and_names_unknown_ones(monkeypatch):
    from logitgate.cli.doctor import format_report, report

    monkeypatch.setenv("LOGITGATE_TREE_MAX_DEPTH", "99")
    monkeypatch.setenv("LOGITGATE_TREE_MAX_DEPTHS", "5")
    monkeypatch.delenv("LOGITGATE_DEVICE", raising=False)
    data = report("cpu")
    assert data["env"]["LOGITGATE_TREE_MAX_DEPTH"] == "99" and data["env"]["LOGITGATE_DEVICE"] == ""
    text = format_report(data)
    assert "  LOGITGATE_TREE_MAX_DEPTH=99\n" in text and "  LOGITGATE_DEVICE=(unset)\n" in text
    assert "  LOGITGATE_TREE_MAX_DEPTHS=5  (logitgate reads no such variable" in text
