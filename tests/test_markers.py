"""The markers tests/conftest.py sets (tests/helpers/markers.py) (`make test-fast` deselects `slow` and `interpreter`): every
`SLOW` entry still names a test, and `interpreter` selects exactly the Triton-under-the-interpreter
instances of a test module."""
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.markers import SLOW, TESTS_DIR

ROOT = TESTS_DIR.parent


@pytest.mark.parametrize("entry", SLOW)
def test_every_slow_entry_names_a_test(entry):
    where, _, name = entry.partition("::")
    path = TESTS_DIR / where
    assert path.exists(), f"SLOW names {where}, which is not under tests/"
    if where.endswith("/"):
        assert path.is_dir() and not name, f"SLOW: {entry} is a folder entry"
    elif name:
        assert re.search(rf"^def {re.escape(name)}\(", path.read_text(), re.M), f"SLOW: {where} has no test {name}"


def _collected(*args: str) -> list[str]:
    # ROOT first, the caller's PYTHONPATH kept: the GPU machines bring packages in through it
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 5), proc.stdout[-2000:] + proc.stderr[-2000:]  # 5: nothing selected
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_interpreter_marks_exactly_the_interpreted_triton_instances():
    pytest.importorskip("triton")
    module = "tests/structured/tree/test_tree_semantics.py"
    everything = _collected(module)
    interpreted = _collected(module, "-m", "interpreter")
    assert interpreted and all("npu-emulated-triton" in node for node in interpreted), interpreted
    assert set(interpreted) == {node for node in everything if "npu-emulated-triton" in node}
    assert set(_collected(module, "-m", "not interpreter")) == set(everything) - set(interpreted)
