"""Forced drafts: the tokens a request's constraint fixes are verified in one forward pass (the
`forced` operation of LOGITGATE_VLLM_OPS, switched on by LOGITGATE_VLLM_FORCED_DRAFTS).

After the scheduler advances a structured request's grammar with the step's tokens, the grammar
is asked what it fixes next (logitgate/structured/forced.py: xgrammar's jump-forward string in the
model's tokenization, llguidance's fast-forward tokens, a tree's unique continuation). Those tokens
become the request's `spec_token_ids`: vLLM schedules them as drafts, its structured-output manager
fills a mask row per draft position, and the model runner computes every position in one pass and
verifies the drafts with the rejection sampler under those masks. The output distribution is
vLLM's masked decoding: a greedy row keeps the argmax of each masked position, a random row accepts
a draft with its masked target probability and otherwise draws from the masked target without it
(the draft is a point mass), so the emitted tokens follow the same law as one pass per token.

No server-wide speculative config is needed (scheduler.py, worker.py): steps without drafts run
vLLM's plain path, so min_p / logit_bias / custom logits processors are not refused. Under a
user's drafter (`--speculative-config`), the drafter's tokens stand and the grammar's replace them
where it fixes more tokens than the drafter proposed (scheduler.update_draft_token_ids_replacement);
under a drafter that proposes from tokens alone (n-gram, suffix) the grammar's draft rows are
verified over their allowed tokens beside the drafter's whole rows (sparse.py).

Rows left out of drafting (they decode one token per pass, as in vLLM): proposals.why_not_drafted.
"""
from __future__ import annotations

from .... import envs as _envs

__all__ = ["DRAFTS_ENV", "DEFAULT_DRAFTS", "max_drafts"]

DRAFTS_ENV = "LOGITGATE_VLLM_FORCED_DRAFTS"
DEFAULT_DRAFTS = 0  # off by default: see docs/vllm.md, "Forced drafts" (the measurements behind it)

_parsed: dict[str | None, int] = {}


def max_drafts(value: str | None = None) -> int:
    """Most forced tokens proposed per request and step (0: none, the feature off). ValueError
    naming the variable for anything but an int >= 0."""
    raw = _envs.read(DRAFTS_ENV) if value is None else value
    if raw not in _parsed:
        if raw is None or raw.strip() == "":
            _parsed[raw] = DEFAULT_DRAFTS
        else:
            try:
                number = int(raw)
            except ValueError:
                number = -1
            if number < 0:
                raise ValueError(f"{DRAFTS_ENV}={raw!r}: expected an int >= 0 (forced tokens per step; 0 turns it off)")
            _parsed[raw] = number
    return _parsed[raw]
