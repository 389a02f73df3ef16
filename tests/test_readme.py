"""Every ```python block in README.md runs as written (each in a fresh namespace)."""
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


@pytest.mark.parametrize("line", SHELL_LINES)
def test_readme_shell_commands_exist(line):
    """Shell blocks are not run here (make test would recurse; benchmarks take minutes), but every
    make target they name exists, and every script or `logitgate` command they run answers --help."""
    import subprocess
    import sys

    import os

    root = README.parent
    # This checkout's logitgate, not another copy installed in the interpreter (a worktree).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    words = line.split()
    if words[0] == "make":
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
