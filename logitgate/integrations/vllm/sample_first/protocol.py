"""What crosses between `sample_first`'s scheduler side and its worker side, in one place (as vLLM's
`spec_decode/metadata.py` holds what its scheduler hands its sampler):

- scheduler -> worker: `DeferredRows`, the manager's bitmask carrying the rows left all-ones and the
  grammars the worker should mirror (it rides in vLLM's GrammarOutput, pickled across processes);
- worker -> scheduler: `Report` (with one `Outcome` per deferred row), set on vLLM's
  ModelRunnerOutput under the attribute `REPORT` (pickled with it);
- within the worker, from one replaced vLLM method to the next: the runner keys (`DEFERRED_KEY`
  from `sample_tokens` to `_sample`, `MIRRORS_KEY` for its mirrors) and `sampler_stash` (from
  `_sample` to `Sampler.sample` and back, on the sampling thread).

Every attribute named here is a row of the patch table (patches.py). Nothing here imports torch or
vLLM; the scheduler side and the worker side import this module, never each other.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["BONUS_FREE", "DEFERRED_KEY", "MIRRORS_KEY", "REPORT", "DeferredRows", "Entry", "Outcome", "Report",
           "SamplerStash", "sampler_stash"]

REPORT = "logitgate_sample_first"  # on a ModelRunnerOutput: the worker's Report
DEFERRED_KEY = "_logitgate_deferred_rows"  # on a runner: this step's deferred rows, from sample_tokens to _sample
MIRRORS_KEY = "_logitgate_mirrors"  # on a runner: its GrammarMirrors, False where it cannot mirror
# On a vLLM Request, set by forced drafts (forced/proposals.py) for the step its drafts are verified:
# True where the drafts reach the end of the forced string, so the bonus row after them is a free
# state the scheduler may defer like a row without drafts (the worker checks it past the drafts).
BONUS_FREE = "_logitgate_bonus_free"

# request id -> (grammar, temperature, start, tokens): see DeferredRows
Entry = tuple[Any, float, int, tuple[int, ...]]


class DeferredRows(np.ndarray):
    """The manager's bitmask with what travels to the worker beside it:

    - `deferred`: request id -> (grammar, temperature, start, tokens) of the rows left all-ones.
      `grammar` is the scheduler's own where the runner samples in its process; None across
      processes, where the worker's mirror stands in for it, advanced first with `tokens`, the
      request's output tokens from position `start` on.
    - `mirror`: request id -> grammar backend name ("xgrammar", "guidance"): requests the worker
      should start mirroring, in the scheduler's backend (their rows are filled meanwhile)."""

    deferred: dict[str, Entry]
    mirror: dict[str, str]

    @classmethod
    def wrap(cls, bitmask: np.ndarray, deferred: dict[str, Entry], mirror: dict[str, str] | None = None) -> "DeferredRows":
        out = bitmask.view(cls)
        out.deferred = deferred
        out.mirror = mirror or {}
        return out

    def __array_finalize__(self, obj: Any) -> None:
        # Slices and copies are plain bitmask rows: only the object the manager returned defers.
        self.deferred = {}
        self.mirror = {}

    def __reduce_ex__(self, protocol: int) -> tuple:
        # To the worker process with its rows: a grammar object in them fails to pickle, loudly.
        return _rebuild, (np.asarray(self), self.deferred, self.mirror)


def _rebuild(bitmask: np.ndarray, deferred: dict, mirror: dict | None = None) -> DeferredRows:
    return DeferredRows.wrap(bitmask, deferred, mirror)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one deferred row ended in the worker: `how` is "accepted" (the first draw), "redrawn"
    (among the best keys), "filled" (the worker filled its mask) or "unchecked" (its mirror failed;
    `why` says how); `seconds`: the worker's time on it beyond sampling."""

    how: str
    seconds: float = 0.0
    why: str = ""


@dataclasses.dataclass
class Report:
    """What the worker tells the scheduler with each sampled output (pickled with it across
    processes): whether it keeps mirrors, the mirrors that became ready or failed since the last
    report, and the outcome of every deferred row."""

    mirrors: bool = False
    ready: tuple[str, ...] = ()
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    outcomes: dict[str, Outcome] = dataclasses.field(default_factory=dict)


class SamplerStash(threading.local):
    """From the runner's `_sample` to `Sampler.sample` and back, on the thread that samples."""

    rows: list[int] | None = None  # batch rows whose processed logits `Sampler.sample` keeps
    logits: "torch.Tensor | None" = None


sampler_stash = SamplerStash()
