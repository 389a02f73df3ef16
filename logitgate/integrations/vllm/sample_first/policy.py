"""Per row and per step: does a structured-output row sample before its mask is filled?

Sampling first saves the scheduler's fill of the row when the draw is accepted, and costs the
worker a check of the draw (and, across processes, advancing the row's mirror); a rejected draw
also costs a redraw among the best keys and, where none of them is allowed, a fill in the worker
(after the forward pass, where the scheduler's fill would have run beside it). With `a` the
chance that a row's draw is accepted, F the scheduler's fill, C the check and R the rejection's
extra cost, all per row, sampling first pays when

    a * F > C + (1 - a) * R,   i.e.   a > (C + R) / (F + R)   (the break-even).

F, C and R are measured where they are spent (the scheduler times its fills, the worker reports
each row's cost) as the server's running means; `a` is each request's running acceptance, seeded
from the server's, so a model whose draws keep being rejected (a diffuse one at T = 1, or any
model in a part of a schema it has not learnt) stops sampling first after a row or two. A row
below the break-even fills first for `wait` steps, then samples first once more (a probe); each
rejected probe doubles the wait (at most MAX_WAIT), so a hopeless request spends at most one step
in MAX_WAIT on a probe, and an accepted one halves it. Where no acceptance pays (the fill costs
less than a check: xgrammar's cached states) rows probe once in MAX_WAIT steps, only to
measure again.

Pure: no vLLM, no torch. The scheduler keeps one `Policy` per manager and one `RowState` per request.
"""
from __future__ import annotations

import dataclasses

__all__ = ["Costs", "Policy", "RowState"]

PRIOR = 0.75  # the server's acceptance before any row was checked
REQUEST_STEP = 0.25  # weight of one outcome in its request's acceptance
SERVER_STEP = 0.02  # weight of one outcome in the server's acceptance
COST_STEP = 0.05  # weight of one measurement in a cost's running mean
FIRST_WAIT = 2  # steps a row fills first once its acceptance is below the break-even
MAX_WAIT = 32
DEFAULT_BREAK_EVEN = 0.5  # before the fill and a rejection have both been measured


def _mean(old: float | None, new: float, step: float = COST_STEP) -> float:
    return new if old is None else old + step * (new - old)


@dataclasses.dataclass
class Costs:
    """The server's running means, in seconds per row: the scheduler's fill, the worker's check of
    an accepted draw, the worker's whole work on a rejected one."""

    fill: float | None = None
    check: float | None = None
    rejection: float | None = None

    def record_fill(self, seconds: float, rows: int) -> None:
        if rows > 0:
            self.fill = _mean(self.fill, seconds / rows)

    def record_check(self, seconds: float) -> None:
        self.check = _mean(self.check, seconds)

    def record_rejection(self, seconds: float) -> None:
        self.rejection = _mean(self.rejection, seconds)

    def break_even(self) -> float:
        """The acceptance above which sampling first costs less than filling (module docstring);
        above 1 where even an accepted draw costs more than the fill it saves."""
        if self.fill is None:
            return DEFAULT_BREAK_EVEN
        check = self.check or 0.0
        if self.rejection is None:  # no rejection yet: an accepted draw must at least cost less than the fill
            return max(DEFAULT_BREAK_EVEN, check / self.fill) if self.fill > 0 else 1.0
        return (check + self.rejection) / (self.fill + self.rejection) if self.fill + self.rejection > 0 else 1.0


@dataclasses.dataclass
class RowState:
    """One request's part: its acceptance (None until its first decision), the steps it still fills
    first, the wait after its next rejected probe; and, across processes, its mirror's state
    ("" not asked, "asked", "ready", "failed") and the output tokens already shipped to it."""

    acceptance: float | None = None
    wait: int = 0
    backoff: int = FIRST_WAIT
    mirror: str = ""
    shipped: int = 0


@dataclasses.dataclass
class Policy:
    """One engine's decisions: the server's acceptance and costs, and the rule above."""

    acceptance: float = PRIOR
    costs: Costs = dataclasses.field(default_factory=Costs)

    def samples_first(self, row: RowState) -> bool:
        """This step's decision for a row that could sample first (counts down its wait)."""
        if row.acceptance is None:
            row.acceptance = self.acceptance
            break_even = self.costs.break_even()
            if row.acceptance <= break_even:  # the server's draws are mostly rejected: start by filling
                row.wait = row.backoff = MAX_WAIT if break_even >= 1.0 else row.backoff
        if row.wait > 0:
            row.wait -= 1
            return False
        return True

    def would_sample_first(self, row: RowState) -> bool:
        """What samples_first would answer now, without counting down the wait (for a decision
        made a step ahead: forced drafts choose where their drafts end by it)."""
        if row.acceptance is None:
            return self.acceptance > self.costs.break_even()
        return row.wait == 0

    def record(self, row: RowState, accepted: bool) -> None:
        """A deferred row's outcome: was its first draw accepted?"""
        outcome = 1.0 if accepted else 0.0
        row.acceptance = _mean(row.acceptance, outcome, REQUEST_STEP)
        self.acceptance = _mean(self.acceptance, outcome, SERVER_STEP)
        break_even = self.costs.break_even()
        if row.acceptance > break_even:
            row.backoff = FIRST_WAIT
            return
        row.wait = row.backoff
        if break_even >= 1.0:  # no acceptance pays: probe only to re-measure
            row.backoff = MAX_WAIT
        elif accepted:  # recovering: the next probe comes sooner
            row.backoff = max(FIRST_WAIT, row.backoff // 2)
        else:
            row.backoff = min(2 * row.backoff, MAX_WAIT)
