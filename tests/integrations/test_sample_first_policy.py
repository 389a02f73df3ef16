"""sample_first's per-row choice (integrations/vllm/sample_first/policy.py), without vLLM: rows
sample first while their draws are accepted, fill first for a growing while once they are mostly
rejected (with rare probes), start by filling on a server whose draws are mostly rejected, and
never sample first where the measured fill is cheaper than what a check and a rejection cost."""
from __future__ import annotations

import random

import pytest

from logitgate.integrations.vllm.sample_first.policy import MAX_WAIT, Costs, Policy, RowState


def run(policy: Policy, row: RowState, accept_rate: float, steps: int, rng: random.Random) -> int:
    """Steps on which the row sampled first, its draws accepted with `accept_rate`."""
    sampled = 0
    for _ in range(steps):
        if policy.samples_first(row):
            sampled += 1
            policy.record(row, rng.random() < accept_rate)
    return sampled


def test_a_row_whose_draws_are_accepted_keeps_sampling_first():
    policy, row = Policy(), RowState()
    assert run(policy, row, 1.0, 100, random.Random(0)) == 100


def test_a_row_whose_draws_are_rejected_stops_within_a_few_steps_and_probes_rarely():
    policy, row = Policy(), RowState()
    sampled = run(policy, row, 0.0, 400, random.Random(0))
    # Two or three rejections to fall below the break-even, then probes at waits 2, 4, ..., MAX_WAIT.
    assert sampled <= 3 + 400 // MAX_WAIT + 5
    assert row.backoff == MAX_WAIT


def test_a_row_that_recovers_samples_first_again():
    policy, row = Policy(), RowState()
    rng = random.Random(1)
    run(policy, row, 0.0, 100, rng)
    assert run(policy, row, 1.0, 200, rng) > 150


def test_a_server_whose_draws_are_mostly_rejected_starts_new_rows_filled():
    policy = Policy()
    rng = random.Random(2)
    for _ in range(40):  # many requests with hopeless draws
        run(policy, RowState(), 0.05, 50, rng)
    assert policy.acceptance < policy.costs.break_even()
    fresh = RowState()
    assert not policy.samples_first(fresh)  # starts by filling, probes later


@pytest.mark.parametrize("fill, check, rejection, pays", [
    (10e-3, 50e-6, 2e-3, 0.17),  # a 10 ms fill (bounded strings): pays from ~17% acceptance on (clamped to 0.5 below)
    (40e-6, 50e-6, 2e-3, None),  # a fill cheaper than a check: never pays
])
def test_the_break_even_follows_the_measured_costs(fill, check, rejection, pays):
    costs = Costs()
    assert costs.break_even() == 0.5  # nothing measured yet
    for _ in range(200):
        costs.record_fill(fill * 4, 4)
        costs.record_check(check)
        costs.record_rejection(rejection)
    expected = (check + rejection) / (fill + rejection)
    assert costs.break_even() == pytest.approx(expected, rel=1e-6)
    if pays is None:
        assert costs.break_even() > 1.0
        policy, row = Policy(costs=costs), RowState()
        assert run(policy, row, 1.0, 320, random.Random(3)) <= 320 // MAX_WAIT + 4  # probes only
    else:
        assert costs.break_even() == pytest.approx(pays, abs=0.01)


def test_before_any_rejection_a_check_that_costs_a_fill_does_not_pay():
    """llguidance's rows are checked by their filled mask in the worker: before any rejection is
    measured, the break-even is already the check over the fill (at least the default)."""
    from logitgate.integrations.vllm.sample_first.policy import DEFAULT_BREAK_EVEN, Costs

    costs = Costs()
    costs.record_fill(0.001, 1)
    assert costs.break_even() == DEFAULT_BREAK_EVEN  # no check measured yet
    costs.record_check(0.0012)
    assert costs.break_even() >= 1.0
    cheap = Costs()
    cheap.record_fill(0.001, 1)
    cheap.record_check(0.0001)
    assert cheap.break_even() == DEFAULT_BREAK_EVEN
