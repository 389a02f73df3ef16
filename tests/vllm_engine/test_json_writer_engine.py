"""The json_writer model (logitgate.models.json_writer) in a real vLLM engine: it loads in `LLM(...)`
and, with structured outputs on and the plugin loaded, writes a record valid for each served
schema, greedy and at T = 1; and the prompts it is trained and measured after are the ones vLLM's
benchmark client makes for `--dataset-name random`."""
from __future__ import annotations

import pytest

from tests.helpers.json_engine import run_scenario
from tests.helpers.vllm_runtime import needs_vllm_cpu

pytestmark = needs_vllm_cpu


def test_random_prompts_are_the_vllm_benchmark_clients():
    datasets = pytest.importorskip("vllm.benchmarks.datasets.datasets")
    from logitgate.models.random_prompts import random_prompt_texts
    from logitgate.models.real_vocab import load_tokenizer

    tokenizer = load_tokenizer("llama3")
    requests = datasets.RandomDataset(random_seed=0).sample(tokenizer=tokenizer, num_requests=32, input_len=32, output_len=96)
    assert [r.prompt for r in requests] == random_prompt_texts(tokenizer, 32, input_len=32, output_len=96, seed=0)


def test_vllm_writes_valid_records_with_the_json_writer():
    from logitgate.models.json_records import SCHEMAS, check_text
    from logitgate.models.json_writer import json_writer_model

    result = run_scenario("json-writer", True, str(json_writer_model()))
    for name, schema in SCHEMAS.items():
        for mode in ("greedy", "t1"):
            outputs = result[f"{name}_{mode}"]
            assert len(outputs) == 8
            for text, finish in outputs:
                assert finish == "stop" and check_text(text, schema)["exact"], (name, mode, text, finish)
