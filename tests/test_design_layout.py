"""docs/design.md is the design of record: its layout of logitgate/ must stay true.

- Every folder and module the layout lists exists, and so does every `x.py` its entries mention.
- A name an entry writes as a call (`get_backend(device=None)`) or after its module
  (`dfa.py (TreeDFA)`, `manager (StructuredOutputManager)`) is defined there; an identifier with
  an underscore (`tree_args`, `speculative_generate`) is a module, a folder or a name of the entry.
- Every module of the package is in the layout: listed, named in its folder's entry (as `x.py` or
  `x`), or covered by its folder's entry when that folder has no entries of its own beneath it
  (`triton/  every Triton kernel and launcher`); a package's `__init__.py` by its folder's entry."""
import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "logitgate"
DESCRIPTION_COLUMN = 21  # lines indented this far continue the entry above


def _entries() -> list[dict]:
    """The layout's entries under logitgate/: folder (path parts), names (`x.py`, `x/`), text."""
    block = re.search(r"## Layout.*?```\n(.*?)```", (ROOT / "docs" / "design.md").read_text(), re.S).group(1)
    lines = block.split("logitgate/\n", 1)[1].splitlines()
    entries, folders = [], []
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            break  # scripts/, tests/, docs/: outside the package
        if indent >= DESCRIPTION_COLUMN - 1:
            entries[-1]["text"] += " " + line.strip()
            continue
        head = re.match(r"(?:\S+(?:\.py|/)(?:\s+|$))+", line.strip() + " ").group(0)
        del folders[indent // 2 - 1 :]
        entry = {"folder": list(folders), "names": head.split(), "text": line.strip()[len(head) :]}
        entries.append(entry)
        if entry["names"][0].endswith("/"):
            folders.append(entry["names"][0].rstrip("/"))
    return entries


ENTRIES = _entries()


def _paths(entry: dict) -> list[Path]:
    return [PACKAGE.joinpath(*entry["folder"], name.rstrip("/")) for name in entry["names"]]


@cache
def _defined(path: Path) -> frozenset[str]:
    """Top-level names a module defines (functions, classes, assignments)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return frozenset(names)


def _modules(entry: dict) -> list[Path]:
    """The modules an entry speaks for: its own, or every module in its folders."""
    out = []
    for path in _paths(entry):
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: "/".join([*e["folder"], e["names"][0]]))
def test_every_name_the_layout_gives_exists(entry):
    missing = [str(p.relative_to(PACKAGE)) for p in _paths(entry) if not p.exists()]
    modules = [m for m in _modules(entry) if m.exists()]
    stems = {m.stem for m in modules} | {d.name for p in _paths(entry) if p.is_dir() for d in p.rglob("*") if d.is_dir()}
    defined = set().union(*(_defined(m) for m in modules)) if modules else set()
    text = entry["text"]
    # `x.py` and `x_y` as words: `scripts/x.py` (a path outside the package) is not checked
    missing += [f"{name} (mentioned)" for name in re.findall(r"(?<![/\w])(\w+\.py)\b", text)
                if not any(m.name == name for m in modules)]
    missing += [f"{name}() (called)" for name in re.findall(r"\b(\w+)\(", text) if name not in defined]
    missing += [f"{name} (an identifier)" for name in re.findall(r"(?<![/\w])([a-z]\w*_\w*)\b(?!\.py)", text)
                if name not in stems and name not in defined]
    for stem, name in re.findall(r"\b(\w+)(?:\.py)? \(([A-Z]\w+)", text):  # `dfa.py (TreeDFA)`
        module = next((m for m in modules if m.stem == stem), None)
        if module is not None and name not in _defined(module):
            missing.append(f"{name} (not in {stem}.py)")
    assert not missing, f"docs/design.md names what is not there: {missing}"


def test_every_module_is_in_the_layout():
    listed = {p for e in ENTRIES for p in _paths(e)}
    folders = {p for p in listed if p.is_dir()} | {PACKAGE}
    leaves = {p for p in folders if not any(q != p and p in q.parents for q in listed)}  # no entries beneath
    text_of = {p: e["text"] for e in ENTRIES for p in _paths(e) if p.is_dir()}
    unlisted = []
    for module in sorted(PACKAGE.rglob("*.py")):
        folder = module.parent
        named = re.search(rf"\b{re.escape(module.stem)}(\.py)?\b", text_of.get(folder, ""))
        covered = any(f in leaves for f in (folder, *folder.parents) if f in folders)
        if module not in listed and not named and not covered and not (module.name == "__init__.py" and folder in folders):
            unlisted.append(str(module.relative_to(PACKAGE)))
    assert not unlisted, f"modules docs/design.md's layout does not name (add them to it): {unlisted}"


def test_the_layout_is_read():
    """The parser finds the entries (a parser that found none would pass everything)."""
    by_path = {"/".join([*e["folder"], n]): e for e in ENTRIES for n in e["names"]}
    assert {"checks.py", "backends/", "backends/base.py", "backends/cuda.py", "backends/emulated.py",
            "structured/tree/", "integrations/vllm/", "models/", "data/"} <= set(by_path)
    assert "TreeDFA" in by_path["structured/tree/"]["text"] and "threads.py" in by_path["backends/cpu/"]["text"]


EXTERNAL = ("vllm/", "vllm_ascend/", "xgrammar/", "llguidance/", "llama_cpp/", "transformers/", "torch/", "torch_npu/")


def test_every_path_the_docs_name_exists():
    """Not only the layout block: a module or folder any page names (`backends/reference/`,
    `scripts/train_json_writer.py`) exists, at the root or inside logitgate/. Other projects' paths are not
    checked."""
    missing = []
    pages = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    for page in pages:
        for path in re.findall(r"`((?:[\w.-]+/)+[\w-]+\.py|(?:[\w.-]+/)+)`", page.read_text()):
            if path.startswith(EXTERNAL) or path.startswith(("http", "/", "~", ".")) or "*" in path:
                continue
            if not ((ROOT / path).exists() or (PACKAGE / path).exists()):
                missing.append(f"{page.name}: {path}")
    assert not missing, "\n".join(missing)


def test_no_module_outside_the_tree_package_reads_tree_dfa_privates():
    """Other layers read TreeDFA through its face (docs/design.md, "Tree decode across the layers")."""
    dfa = ast.parse((PACKAGE / "structured" / "tree" / "dfa.py").read_text())
    private = {n.attr for n in ast.walk(dfa) if isinstance(n, ast.Attribute) and n.attr.startswith("_")
               and isinstance(n.value, ast.Name) and n.value.id == "self" and not n.attr.startswith("__")}
    found = []
    files = [p for p in PACKAGE.rglob("*.py") if "structured/tree" not in p.as_posix()]
    for path in files + sorted((ROOT / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and re.search(r"(^|\.|_)(tree|dfa)$", ast.unparse(node.value))):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)
