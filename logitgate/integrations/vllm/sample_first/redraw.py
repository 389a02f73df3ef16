"""Choosing again under a grammar: a deferred row whose first token its grammar rejected gets the
masked argmax (greedy) or an exact draw from its distribution restricted to what the grammar allows
(the package docstring proves both). Works on any grammar with vLLM's `validate_tokens` /
`fill_bitmask`; imports nothing of vLLM."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import fill_threads
from . import SAMPLING_EPS

__all__ = ["ATTEMPTS", "CANDIDATES", "choose_again", "fill_masks", "greedy_again", "random_again"]

CANDIDATES = 32  # best tokens a rejected greedy row checks against its grammar before its mask is filled
ATTEMPTS = 4  # draws a rejected sampled row checks against its grammar before its mask is filled
RENORMALISE_BELOW = 2.0 ** -20  # a row's remaining mass below which its probabilities are recomputed


def fill_masks(rows: list[Any], width: int) -> torch.Tensor:
    """The grammars' bitmasks of `rows`, one row each, filled on the pool's threads."""
    bitmask = torch.full((len(rows), width), -1, dtype=torch.int32)

    def fill(chunk: range) -> None:
        for i in chunk:
            rows[i].fill_bitmask(bitmask, i)

    workers = min(fill_threads.cores(), len(rows))
    if workers > 1:  # xgrammar's fill releases the GIL
        for done in [fill_threads.pool().submit(fill, range(w, len(rows), workers)) for w in range(workers)]:
            done.result()
    else:
        fill(range(len(rows)))
    return bitmask



def _first_allowed(grammar: Any, values: list[float], tokens: list[int]) -> int | None:
    """The first of the best tokens (by value, then id) the grammar accepts; None when none is, or
    when the accepted one ties with the last value looked at (an equal token may lie beyond)."""
    order = sorted(range(len(tokens)), key=lambda i: (-values[i], tokens[i]))
    for i in order:
        if values[i] == float("-inf"):  # the logits operations banned it and all below it
            return None
        if len(grammar.validate_tokens([tokens[i]])) == 1:
            return None if values[i] == values[order[-1]] else tokens[i]
    return None


def _fill_is_cheap(grammar: Any) -> bool:
    """xgrammar knows when the next characters are forced (a JSON key, punctuation): there its
    fill costs microseconds and searching candidates would only add to it."""
    matcher = getattr(grammar, "matcher", None)
    return matcher is not None and bool(matcher.find_jump_forward_string())


def _fill_missing(chosen: list[int | None], values: torch.Tensor, grammars: list[Any], width: int,
                  pick: Callable[[torch.Tensor], int]) -> list[int]:
    """Rows still without a token: their masks are filled and `pick` chooses among their allowed
    values (in ascending token order; the ids come from the bitmask's non-zero words), so the cost
    follows what the grammar allows, not V."""
    from ....structured.bitmask import token_ids_from_bitmask  # loaded after vLLM's worker started

    missing = [i for i, token in enumerate(chosen) if token is None]
    if missing:
        bitmask = fill_masks([grammars[i] for i in missing], width)
        for i, allowed in zip(missing, token_ids_from_bitmask(bitmask, values.shape[1])):
            kept = values[i, allowed]
            if not bool(torch.isfinite(kept).any()):
                # Nothing allowed survives the logits operations (e.g. allowed_token_ids disjoint from
                # the grammar): token 0, what vLLM's sampler returns for the all -inf masked row, so
                # the request ends as it would without this operation (its grammar refuses it).
                chosen[i] = 0
            else:
                chosen[i] = allowed[pick(kept)] if len(allowed) > 1 else allowed[0]
    return chosen  # type: ignore[return-value]


def greedy_again(logits: torch.Tensor, grammars: list[Any], width: int, search: list[bool],
                 candidates: int | None = None) -> list[int]:
    """The masked argmax of each row: for `search` rows looked for among the `candidates` best
    tokens, else (or when none of them is allowed) by filling the row's mask; ties go to the
    lowest token id, as torch's argmax breaks them."""
    chosen: list[int | None] = [None] * len(grammars)
    looked = [i for i, wanted in enumerate(search) if wanted]
    if looked:
        top = logits[looked].topk(min(CANDIDATES if candidates is None else candidates, logits.shape[1]), dim=1)
        for i, values, tokens in zip(looked, top.values.tolist(), top.indices.tolist()):
            chosen[i] = _first_allowed(grammars[i], values, tokens)
    return _fill_missing(chosen, logits, grammars, width, lambda allowed: int(allowed.argmax()))


def random_again(logits: torch.Tensor, temperatures: list[float], grammars: list[Any], width: int,
                 search: list[bool], rejected: list[int], attempts: int | None = None) -> list[int]:
    """A fresh draw from each row's distribution softmax(logits / T) restricted to what its grammar
    allows (`logits` is consumed). `search` rows draw from the row without the tokens known to be
    rejected (`rejected`, then every rejected draw) until the grammar accepts one, at most
    `attempts` times: rejection sampling whose proposal only ever loses disallowed tokens, so the
    first accepted draw is exact, and a model that put nearly all its mass on the rejected token is
    not drawn from 1/p(A) times. Other rows, and rows out of attempts, draw once from their row
    with the mask filled."""
    from ....sampling.ops import random_sample  # logitgate's exact CPU draw (float64 sums, unnormalised rows)

    scaled = logits.div_(torch.tensor(temperatures, dtype=logits.dtype).unsqueeze(1))
    scaled[range(len(rejected)), rejected] = float("-inf")
    probs = scaled.softmax(dim=1)
    left = [1.0] * len(grammars)  # each row's mass not yet ruled out
    chosen: list[int | None] = [None] * len(grammars)
    pending = [i for i, wanted in enumerate(search) if wanted]
    for _ in range(ATTEMPTS if attempts is None else attempts):
        if not pending:
            break
        draws = random_sample(probs if len(pending) == len(grammars) else probs[pending]).tolist()
        still = []
        for i, token in zip(pending, draws):
            if len(grammars[i].validate_tokens([token])) == 1:
                chosen[i] = token
                continue
            left[i] -= float(probs[i, token])
            probs[i, token] = 0.0
            scaled[i, token] = float("-inf")
            if left[i] < RENORMALISE_BELOW:  # what is left may have underflowed: softmax it again
                if not bool(torch.isfinite(scaled[i]).any()):
                    continue  # every token with a finite logit is rejected: the filled mask decides
                probs[i] = scaled[i].softmax(dim=0)
                left[i] = 1.0
            still.append(i)
        pending = still
    return _fill_missing(chosen, scaled, grammars, width, lambda allowed: int(random_sample(allowed.softmax(dim=0)[None])[0]))


def choose_again(processed: torch.Tensor, rows: list[tuple[int, Any, float]], rejected: list[int],
                  sampled: list[int], width: int) -> dict[int, int]:
    """Batch row -> token for the `rejected` entries of `rows` ((batch row, grammar, temperature),
    in the order of `processed`'s rows); `sampled`: the batch's first draws."""
    picks = {}
    for greedy in (True, False):
        part = [i for i in rejected if (rows[i][2] < SAMPLING_EPS) == greedy]
        if not part:
            continue
        grammars = [rows[i][1] for i in part]
        search = [not _fill_is_cheap(g) for g in grammars]
        values = processed if len(part) == processed.shape[0] else processed[part]  # consumed below
        if greedy:
            tokens = greedy_again(values, grammars, width, search)
        else:
            temperatures, first = [rows[i][2] for i in part], [sampled[rows[i][0]] for i in part]
            tokens = random_again(values, temperatures, grammars, width, search, first)
        picks.update((rows[i][0], token) for i, token in zip(part, tokens))
    return picks

