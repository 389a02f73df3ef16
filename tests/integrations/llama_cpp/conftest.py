"""Fixtures for the llama.cpp integration: the real llama-cpp-python and a tiny random Llama with the
real Llama-3 tokenizer (and one with the Llama-2 SentencePiece tokenizer), written as a GGUF file
offline (logitgate.models.tiny_gguf). Tests skip, saying why, only where llama-cpp-python is not installed (`make test` builds and installs it) or
the GGUF vocabulary cannot be had."""
from pathlib import Path

import pytest

_LOG = Path(__file__).resolve().parents[3] / ".whl" / "llama-cpp-build.log"
llama_cpp = pytest.importorskip(
    "llama_cpp",
    reason="llama-cpp-python is not installed: `make test` builds it from its source distribution into .whl/"
    + (f"; the last build log is {_LOG}" if _LOG.exists() else ""),
)
if not hasattr(llama_cpp, "Llama"):  # without the package, this very folder imports as a namespace `llama_cpp`
    pytest.skip("llama-cpp-python is not installed (`llama_cpp` is only this test folder here)", allow_module_level=True)


def _tiny_model(vocab):
    from logitgate.models.tiny_gguf import tiny_llama_gguf

    try:
        return str(tiny_llama_gguf(vocab=vocab))
    except (ImportError, RuntimeError) as exc:  # gguf missing, or the registry unreachable
        pytest.skip(f"tiny GGUF model unavailable here: {exc}")


@pytest.fixture(scope="session")
def model_path():
    return _tiny_model("llama3")


@pytest.fixture(scope="session")
def llama2_path():
    """The same tiny model with the Llama-2 SentencePiece vocabulary (32000 tokens)."""
    return _tiny_model("llama2")


@pytest.fixture(scope="module")
def llm(model_path):
    from tests.helpers.llama_helpers import load

    model = load(model_path)
    yield model
    model.close()


@pytest.fixture(scope="module")
def llm2(llama2_path):
    from tests.helpers.llama_helpers import load

    model = load(llama2_path)
    yield model
    model.close()
