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
