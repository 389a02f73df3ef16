"""The layers point one way: backends -> structured -> sampling -> decode -> integrations. No module
of structured/ imports a layer above it, at the top or inside a function (a module's `__getattr__`
alias of a moved name is the one exception: it runs only when a caller asks for the old path)."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "logitgate"
ABOVE_STRUCTURED = ("sampling", "decode", "integrations", "cli")


def _imports(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            continue  # the old-path alias hook
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom):
                yield inner.lineno, inner.level, inner.module or ""
            elif isinstance(inner, ast.Import):
                for alias in inner.names:
                    yield inner.lineno, 0, alias.name


@pytest.mark.parametrize("path", sorted((PACKAGE / "structured").rglob("*.py")), ids=lambda p: p.name)
def test_structured_imports_no_layer_above(path):
    bad = []
    for line, level, module in _imports(ast.parse(path.read_text())):
        # Absolute imports name the package; relative ones from structured/ reach logitgate at level 2.
        top = module.split(".")[1] if level == 0 and module.startswith("logitgate.") else (module.split(".")[0] if level == 2 else "")
        if top in ABOVE_STRUCTURED:
            bad.append(f"{path.name}:{line} imports {'.' * level}{module}")
    assert not bad, bad
