"""The documentation runs as written. Every page (README.md and docs/*.md) executes its ```python
blocks in order, in one namespace per page; every ```bash line names what exists (see
test_shell_commands_exist). Blocks that need an engine are fenced otherwise and run elsewhere:
```py and ```sh blocks of docs/vllm.md (and the README's ```py copy of its script) in
tests/vllm_engine/test_readme_vllm.py; ```text blocks are never run. README.md stays a front page
(at most MAX_README_LINES lines) whose index links every page of docs/, and every relative link
of every page resolves (file and heading). A block that imports a package this host lacks (e.g.
llama-cpp-python on a GPU machine) skips the rest of its page, naming the package."""
import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from logitgate.models.real_vocab import VocabularyUnavailable
from tests.helpers.doc_blocks import blocks, command_words

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
MAX_README_LINES = 220


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


_blocks = blocks


PYTHON_PAGES = [page for page in PAGES if _blocks(page, "python")]


def test_pages_have_examples():
    assert len(_blocks(README, "python")) >= 4
    assert len(PYTHON_PAGES) >= 10


def _missing_import(code: str) -> str | None:
    """The first top-level package `code` imports that is not installed here, else None. A directory
    of that name on sys.path is not the package (tests/integrations/llama_cpp, a namespace package
    without a file, is what `import llama_cpp` finds when llama-cpp-python is absent)."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            spec = importlib.util.find_spec(top)
            if spec is None or spec.origin is None:
                return top
    return None


def test_missing_imports_are_found():
    assert _missing_import("import torch\nfrom logitgate.sampling import ops") is None
    assert _missing_import("import os\nfrom no_such_package_here import x") == "no_such_package_here"


def test_namespace_directories_are_not_packages(tmp_path, monkeypatch):
    (tmp_path / "llama_cpp_lookalike").mkdir()  # a directory without __init__.py, as tests/integrations/llama_cpp
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _missing_import("from llama_cpp_lookalike import Llama") == "llama_cpp_lookalike"


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=_name)
def test_page_examples_run(page, capsys):
    """A page's python blocks run in order in one namespace (a later block may use an earlier one's names)."""
    namespace = {"__name__": "__readme__"}
    for index, code in enumerate(_blocks(page, "python")):
        missing = _missing_import(code)
        if missing is not None:
            pytest.skip(f"{_name(page)}[python block {index}] imports {missing}, which is not installed here")
        try:
            exec(compile(code, f"{_name(page)}[python block {index}]", "exec"), namespace)
        except VocabularyUnavailable as exc:  # a machine without network and without the cached vocabularies
            pytest.skip(f"{_name(page)}[python block {index}] needs the real vocabularies, unavailable here: {exc}")


def test_readme_vllm_script_is_the_tested_one():
    """The README's ```py script is docs/vllm.md's, which tests/vllm_engine/test_readme_vllm.py runs in a real engine."""
    assert _blocks(README, "py") == _blocks(DOCS / "vllm.md", "py") != []


def test_readme_is_a_front_page():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}): move the detail to docs/"


def test_every_docs_page_is_in_the_readme_index():
    index = README.read_text().split("\n## Documentation\n", 1)[1]
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)\)", index))
    pages = {_name(page) for page in DOCS.glob("*.md")}
    assert pages - linked == set(), f"docs pages missing from the README's index: {sorted(pages - linked)}"
    assert linked - pages == set(), f"the README's index links pages that do not exist: {sorted(linked - pages)}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped (but - and _), spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


LINKS = [(page, target) for page in PAGES
         for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M))
         if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page, target", LINKS, ids=[f"{_name(p)}->{t}" for p, t in LINKS])
def test_links_resolve(page, target):
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    assert linked.is_file(), f"{_name(page)} links {target}: no such file"
    if anchor:
        assert anchor in _anchors(linked), f"{_name(page)} links {target}: {linked.name} has no such heading"


SHELL_LINES = [
    (page, line.split("#")[0].strip())
    for page in PAGES
    for block in _blocks(page, "bash")
    for line in block.splitlines()
    if command_words(line)[1]
]


def _pip_line_problem(words: list[str], root: Path) -> str | None:
    """A documented `pip` line installs what exists: logitgate from the clone (`.`) with extras that
    pyproject.toml defines, other packages exactly as the Makefile installs or removes them."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    makefile = (root / "Makefile").read_text()
    args = [w.strip("\"'") for w in words[2:] if not w.startswith("-")]
    for arg in args:
        name, _, extra = arg.partition("[")
        if name == "." or name.startswith("/"):
            if name != ".":
                return f"the docs install {arg!r}: name the clone as '.'"
            missing = [e for e in extra.rstrip("]").split(",") if e and e not in extras]
            if missing:
                return f"the docs name extra(s) {missing} that pyproject.toml does not define ({sorted(extras)})"
        elif re.split(r"[<>=\[]", name)[0] == "logitgate":
            return f"the docs install {arg!r} from a registry, where logitgate is not published"
        elif words[1] == "install" and arg not in makefile:
            return f"the docs install {arg!r}, which the Makefile does not install"
        elif words[1] == "uninstall" and not re.search(rf"pip uninstall .*\b{re.escape(arg)}\b", makefile):
            return f"the docs uninstall {arg!r}, which the Makefile does not"
    return None


@pytest.mark.parametrize("page, line", SHELL_LINES, ids=[f"{_name(p)}: {line}" for p, line in SHELL_LINES])
def test_shell_commands_exist(page, line):
    """```bash blocks are not run here (make test would recurse; benchmarks take minutes), but every
    make target they name exists, every script, module (`python -m logitgate.bench.NAME`) or `logitgate`
    command they run answers --help and
    every `pip` line installs what exists (as the Makefile, which CI runs, installs it). Leading
    NAME=value assignments (CMAKE_ARGS=...) are the command's environment."""
    # This checkout's logitgate, not another copy installed in the interpreter (a worktree).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    words = command_words(line)[1]
    where = _name(page)
    if words[0] == "pip":
        problem = _pip_line_problem(words, ROOT)
        assert problem is None, f"{where}: {problem}"
    elif words[0] == "make":
        targets = re.findall(r"(?m)^([a-z][a-z-]*):", (ROOT / "Makefile").read_text())
        assert words[1] in targets, f"{where} runs `make {words[1]}`, which the Makefile does not define"
    elif words[1:3] == ["-m", "logitgate"]:
        out = subprocess.run([sys.executable, "-m", "logitgate", words[3], "--help"], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
    elif words[1] == "-m" and words[2].startswith("logitgate."):  # a benchmark or the GPU check, run as a module
        out = subprocess.run([sys.executable, "-m", words[2], "--help"], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, f"{where} runs `python -m {words[2]}`: {out.stderr[-2000:]}"
    else:
        script = next(w for w in words if w.endswith(".py"))
        assert (ROOT / script).is_file(), f"{where} runs {script}, which does not exist"
        out = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr


def test_pip_lines_are_checked_against_pyproject_and_the_makefile():
    assert _pip_line_problem("pip install -e .[hf,xgrammar]".split(), ROOT) is None
    assert "does not define" in _pip_line_problem("pip install -e .[hf,gpu]".split(), ROOT)
    assert "not published" in _pip_line_problem(['pip', 'install', '"logitgate[vllm]"'], ROOT)
    assert "Makefile does not install" in _pip_line_problem("pip install vllm==0.1".split(), ROOT)
