"""Every ```python block in README.md runs as written (each in a fresh namespace); every ```bash line
names what exists (see test_readme_shell_commands_exist)."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, capsys):
    code = BLOCKS[index]
    exec(compile(code, f"README.md[python block {index}]", "exec"), {"__name__": "__readme__"})


SHELL_LINES = [
    line.split("#")[0].strip()
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    for line in block.splitlines()
    if line.split("#")[0].strip()
]


def _pip_line_problem(words: list[str], root: Path) -> str | None:
    """A README `pip` line installs what exists: logitgate from the clone (`.`) with extras that
    pyproject.toml defines, other packages exactly as the Makefile installs or removes them."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    makefile = (root / "Makefile").read_text()
    args = [w.strip("\"'") for w in words[2:] if not w.startswith("-")]
    for arg in args:
        name, _, extra = arg.partition("[")
        if name == "." or name.startswith("/"):
            if name != ".":
                return f"README installs {arg!r}: name the clone as '.'"
            missing = [e for e in extra.rstrip("]").split(",") if e and e not in extras]
            if missing:
                return f"README names extra(s) {missing} that pyproject.toml does not define ({sorted(extras)})"
        elif re.split(r"[<>=\[]", name)[0] == "logitgate":
            return f"README installs {arg!r} from a registry, where logitgate is not published"
        elif words[1] == "install" and arg not in makefile:
            return f"README installs {arg!r}, which the Makefile does not install"
        elif words[1] == "uninstall" and not re.search(rf"pip uninstall .*\b{re.escape(arg)}\b", makefile):
            return f"README uninstalls {arg!r}, which the Makefile does not"
    return None


@pytest.mark.parametrize("line", SHELL_LINES)
def test_readme_shell_commands_exist(line):
    """```bash blocks are not run here (make test would recurse; benchmarks take minutes), but every
    make target they name exists, every script or `logitgate` command they run answers --help and
    every `pip` line installs what exists (as the Makefile, which CI runs, installs it). The ```sh
    blocks of "logitgate in vLLM" run as written in tests/vllm_engine/test_readme_vllm.py."""
    import subprocess
    import sys

    import os

    root = README.parent
    # This checkout's logitgate, not another copy installed in the interpreter (a worktree).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    words = line.split()
    if words[0] == "pip":
        problem = _pip_line_problem(words, root)
        assert problem is None, problem
    elif words[0] == "make":
        targets = re.findall(r"(?m)^([a-z][a-z-]*):", (root / "Makefile").read_text())
        assert words[1] in targets, f"README runs `make {words[1]}`, which the Makefile does not define"
    elif words[1:3] == ["-m", "logitgate"]:
        out = subprocess.run([sys.executable, "-m", "logitgate", words[3], "--help"], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
    else:
        script = next(w for w in words if w.endswith(".py"))
        assert (root / script).is_file(), f"README runs {script}, which does not exist"
        out = subprocess.run([sys.executable, str(root / script), "--help"], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr


def test_pip_lines_are_checked_against_pyproject_and_the_makefile():
    root = README.parent
    assert _pip_line_problem("pip install -e .[hf,xgrammar]".split(), root) is None
    assert "does not define" in _pip_line_problem("pip install -e .[hf,gpu]".split(), root)
    assert "not published" in _pip_line_problem(['pip', 'install', '"logitgate[vllm]"'], root)
    assert "Makefile does not install" in _pip_line_problem("pip install vllm==0.1".split(), root)
