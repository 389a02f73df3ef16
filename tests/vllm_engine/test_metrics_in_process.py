"""logitgate's counters (integrations/vllm/metrics.py) in the OpenAI-compatible server with the
in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: the worker runs in the engine core's
process, the API server in its own), on the demo target, one server for the module. vLLM's default
layout is test_hostile_server.py's, several API servers test_served_modes.py's, the `LLM` program
(one process, or vLLM's defaults) test_engine_kernels.py's.

Checked: every declared counter is on /metrics before any request; JSON requests, greedy and
unseeded T=1, add one bitmask row per token they sampled, filled while the model ran; and the
engine core's periodic line (every VLLM_LOG_STATS_INTERVAL, 1 s here) ends on the totals /metrics
shows."""
from __future__ import annotations

import json
import re
import time

import pytest

from tests.helpers.json_engine import DEMO_JSON_MAX_TOKENS, DEMO_SCHEMA, STRUCTURED_OUTPUTS_CONFIG, demo_json_prompts
from tests.helpers.server_helpers import logitgate_counters, metrics_page, post, running_server
from tests.helpers.vllm_runtime import needs_vllm_cpu

pytestmark = needs_vllm_cpu

LOG_INTERVAL_S = 1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    with running_server(log, "--structured-outputs-config", json.dumps(STRUCTURED_OUTPUTS_CONFIG),
                        VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOG_STATS_INTERVAL=str(LOG_INTERVAL_S)) as s:
        yield s


def _json_requests(server, temperature: float) -> int:
    """One batch of DEMO_SCHEMA requests; the tokens it sampled."""
    from logitgate.models.demo import TARGET_DIR

    status, answer = post(f"{server.url}/v1/completions", {
        "model": str(TARGET_DIR), "prompt": demo_json_prompts(), "max_tokens": DEMO_JSON_MAX_TOKENS,
        "return_token_ids": True, "temperature": temperature, "structured_outputs": {"json": DEMO_SCHEMA}})
    assert status == 200, answer
    return sum(len(choice["token_ids"]) for choice in answer["choices"])


def _last_logged_totals(log: str) -> dict[str, float]:
    """The totals of the last periodic line: `<name in words> +<gained> (<total>)` per counter."""
    lines = [line for line in log.splitlines() if "logitgate counters, last" in line]
    assert lines and all("EngineCore" in line for line in lines), lines  # the process that counts logs
    return {words.replace(" ", "_"): float(total)
            for words, total in re.findall(r"([a-z][a-z ]*?) \+[0-9.]+ \(([0-9.]+)\)", lines[-1].split("(total): ")[1])}


def test_counters_count_the_requests_sent_and_the_periodic_line_agrees(server):
    from logitgate.integrations.vllm.metrics import COUNTERS

    before = logitgate_counters(metrics_page(server.url))
    assert before == dict.fromkeys(COUNTERS, 0.0)  # listed from start-up, nothing counted yet
    sampled = _json_requests(server, 0.0) + _json_requests(server, 1.0)
    after = logitgate_counters(metrics_page(server.url))
    assert after["scheduler_fill_rows"] + after["sample_first_rows_deferred"] == sampled, after
    assert 0 < after["fill_ahead_batches"] <= after["scheduler_fill_batches"], after
    assert after["scheduler_fill_seconds"] > 0 and after["scheduler_fill_wait_seconds"] > 0, after
    time.sleep(3 * LOG_INTERVAL_S)  # the line of the last interval that moved
    logged = _last_logged_totals(server.log_text())
    assert set(logged) == {name for name, value in after.items() if value}, logged
    for name, total in logged.items():
        assert total == pytest.approx(after[name], abs=1e-3), (name, logged, after)
