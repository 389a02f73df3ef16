"""Fixtures for the llama.cpp integration: the real llama-cpp-python and a tiny random Llama with the
real Llama-3 tokenizer, written as a GGUF file offline (logitgate.models.tiny_gguf). Tests skip,
saying why, only where llama-cpp-python is not installed (`make test` builds and installs it) or
the GGUF vocabulary cannot be had."""
from pathlib import Path

import pytest

_LOG = Path(__file__).resolve().parents[3] / ".whl" / "llama-cpp-build.log"
llama_cpp = pytest.importorskip(
    "llama_cpp",
    reason="llama-cpp-python is not installed: `make test` builds it from its source distribution into .whl/"
    + (f"; the last build log is {_LOG}" if _LOG.exists() else ""),
)


@pytest.fixture(scope="session")
def model_path():
    from logitgate.models.tiny_gguf import tiny_llama_gguf

    try:
        return str(tiny_llama_gguf(vocab="llama3"))
    except (ImportError, RuntimeError) as exc:  # gguf missing, or the registry unreachable
        pytest.skip(f"tiny GGUF model unavailable here: {exc}")


def load(model_path, **kwargs):
    options = dict(n_ctx=1024, n_batch=256, n_threads=1, seed=0, verbose=False)
    options.update(kwargs)
    return llama_cpp.Llama(model_path=model_path, **options)


@pytest.fixture(scope="module")
def llm(model_path):
    model = load(model_path)
    yield model
    model.close()


CITIES = [
    "Amsterdam", "Athens", "Auckland", "Bangkok", "Barcelona", "Berlin", "Bogota", "Brussels",
    "Budapest", "Buenos Aires", "Cairo", "Cape Town", "Chicago", "Copenhagen", "Dublin", "Edinburgh",
    "Helsinki", "Hong Kong", "Istanbul", "Jakarta", "Johannesburg", "Kyiv", "Lagos", "Lisbon",
    "London", "Los Angeles", "Madrid", "Manila", "Melbourne", "Mexico City", "Montreal", "Moscow",
    "Mumbai", "Nairobi", "New Delhi", "New York", "Oslo", "Paris", "Prague", "Reykjavik", "Rome",
    "San Francisco", "Santiago", "Seoul", "Singapore", "Stockholm", "Sydney", "Taipei", "Tokyo",
    "Toronto", "Vancouver", "Vienna", "Warsaw", "Zurich",
]


class Trie:
    """Reference: the allowed next tokens of a set of token sequences, as a plain dict trie (does not
    use logitgate), EOS allowed where a sequence ends."""

    def __init__(self, sequences, eos):
        self.root, self.eos = {}, eos
        for seq in sequences:
            node = self.root
            for t in seq:
                node = node.setdefault(t, {})
            node[eos] = None

    def allowed(self, prefix):
        node = self.root
        for t in prefix:
            node = node[t]
        return sorted(node)


def logits_after(llm, tokens):
    """The model's next-token logits after `tokens` (evaluated from scratch)."""
    import numpy as np

    llm.reset()
    llm.eval(tokens)
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()
