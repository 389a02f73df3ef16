"""Shared fixtures for the integration tests: the embedded demo models (loaded once per session),
their tokenizer and catalog, the catalog tree and an xgrammar TokenizerInfo built offline."""
import pytest
import torch

pytest.importorskip("transformers")
xgr = pytest.importorskip("xgrammar")

from transformers.utils import logging as hf_logging  # noqa: E402

from logitgate import TreeDFA  # noqa: E402
from logitgate.models import demo_tokenizer, load_catalog, load_demo_models, load_tree_config  # noqa: E402

hf_logging.disable_progress_bar()


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The demo models are tiny: a second intra-op thread only adds hand-off cost, and on a shared
    host it makes every forward pass wait for a busy core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def models():
    """(target, draft): Hugging Face LlamaForCausalLM pair on the CPU."""
    return load_demo_models()


@pytest.fixture(scope="session")
def tok():
    return demo_tokenizer()


@pytest.fixture(scope="session")
def catalog():
    return set(load_catalog())


@pytest.fixture(scope="session")
def tree():
    return TreeDFA.from_prefix_dict(load_tree_config())


@pytest.fixture(scope="session")
def tokenizer_info(tok):
    return xgr.TokenizerInfo(tok.token_bytes(), vocab_size=tok.vocab_size, stop_token_ids=[tok.eos_token_id])
