"""docs/llama_cpp.md's install line is the Makefile's build: the same CMAKE_ARGS, and one
llama-cpp-python version everywhere it is named (the Makefile, the `llama-cpp` extra, the private-reads
table and the source distribution real_vocab downloads). The line itself and the page's example run
in a fresh virtual environment in tests/integrations/llama_cpp/test_newcomer_path.py."""
import re
from pathlib import Path

import pytest

from logitgate.integrations.llama_cpp.private_reads import TESTED_VERSION
from logitgate.models.real_vocab import SDIST_VERSION
from tests.helpers.doc_blocks import blocks, command_words

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "llama_cpp.md"


def install_line() -> tuple[dict[str, str], list[str]]:
    """(environment, words) of the page's `pip install` line with the `llama-cpp` extra."""
    for block in blocks(PAGE, "bash"):
        for line in block.splitlines():
            env, words = command_words(line)
            if words[:2] == ["pip", "install"] and any("[llama-cpp]" in w for w in words):
                return env, words
    raise AssertionError(f"{PAGE.name} has no ```bash line `pip install ... .[llama-cpp]`")


def makefile_variable(name: str) -> str:
    text = (ROOT / "Makefile").read_text()
    found = re.search(rf"^{name}\s*[:?]?=\s*((?:.*\\\n)*.*)$", text, flags=re.M)
    assert found, f"the Makefile defines no {name}"
    return " ".join(found.group(1).replace("\\\n", " ").split())


def test_the_documented_cmake_args_are_the_makefiles():
    env, _ = install_line()
    documented = env["CMAKE_ARGS"].replace("$PWD", "$(CURDIR)")
    assert documented.split() == makefile_variable("LLAMA_CPP_CMAKE_ARGS").split()


def test_one_llama_cpp_python_version():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["llama-cpp"]
    pins = [r.split("==")[1] for r in extra if r.startswith("llama-cpp-python==")]
    assert pins == [TESTED_VERSION] == [SDIST_VERSION] == [makefile_variable("LLAMA_CPP_VERSION")]
    assert {re.split(r"[<>=]", r)[0] for r in extra} >= {"gguf", "xgrammar"}  # the example's imports
