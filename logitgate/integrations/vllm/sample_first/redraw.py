"""Choosing again under a grammar: a deferred row whose first token its grammar rejected gets the
masked argmax (greedy) or an exact draw from its distribution restricted to what the grammar allows
(the package docstring proves both), from one ordering of the row: its logits (greedy) or one
exponential race over them (sampled). The best CANDIDATES keys are checked in order; where none is
allowed the row's mask is filled and the argmax of the same keys over the allowed tokens taken.
Works on any grammar with vLLM's `validate_tokens` / `fill_bitmask`; imports nothing of vLLM."""
from __future__ import annotations

from typing import Any

import torch

from ....cores import usable_cores
from ..fill_threads import fill_pool
from . import SAMPLING_EPS

__all__ = ["CANDIDATES", "allows", "choose_again", "fill_masks", "race_keys", "validates_as_its_mask"]

CANDIDATES = 32  # best keys a rejected row checks against its grammar before its mask is filled
# vLLM's grammar classes whose `validate_tokens` accepts exactly the tokens their mask allows.
# llguidance's (GuidanceGrammar) does not: it accepts non-canonical tokenizations its mask excludes
# (at a forced key `"ok"` the mask allows the token `ok` alone, validate_tokens also `o`), and once
# its grammar is complete it refuses the stop token its mask allows. Any other grammar is checked
# by its mask, like llguidance's.
VALIDATES_AS_MASK = frozenset({"XgrammarGrammar"})


def validates_as_its_mask(grammar: Any) -> bool:
    """Whether `grammar.validate_tokens` can stand for its mask (a class may say so itself)."""
    return bool(getattr(type(grammar), "validates_as_mask", type(grammar).__name__ in VALIDATES_AS_MASK))


def allows(mask: torch.Tensor, token: int) -> bool:
    """Whether the packed bitmask row `mask` (int32 words, vLLM's layout) allows `token`."""
    word = token // 32
    return word < mask.shape[0] and bool(int(mask[word]) & (1 << (token % 32)))


def fill_masks(grammars: list[Any], width: int) -> torch.Tensor:
    """The grammars' bitmasks, one row each, filled on the pool's threads."""
    bitmask = torch.full((len(grammars), width), -1, dtype=torch.int32)

    def fill(chunk: range) -> None:
        for i in chunk:
            grammars[i].fill_bitmask(bitmask, i)

    workers = min(usable_cores(), len(grammars))
    if workers > 1:  # xgrammar's and llguidance's fills release the GIL
        for done in [fill_pool().submit(fill, range(w, len(grammars), workers)) for w in range(workers)]:
            done.result()
    else:
        fill(range(len(grammars)))
    return bitmask


def race_keys(logits: torch.Tensor, temperatures: list[float], generator: torch.Generator | None = None) -> torch.Tensor:
    """Each row's order of preference, in place on `logits`: the logits for greedy rows; for sampled
    rows logits / T - log(E), E ~ Exp(1), whose argmax over any token set is an exact draw from
    softmax(logits / T) restricted to that set (-inf stays -inf)."""
    sampled = [i for i, t in enumerate(temperatures) if t >= SAMPLING_EPS]
    if sampled:
        rows = logits if len(sampled) == logits.shape[0] else logits[sampled]
        noise = torch.empty_like(rows).exponential_(generator=generator).log_()
        scaled = rows.div_(torch.tensor([temperatures[i] for i in sampled], dtype=rows.dtype).unsqueeze(1)).sub_(noise)
        if rows is not logits:
            logits[sampled] = scaled
    return logits


def _first_allowed(grammar: Any, values: list[float], tokens: list[int]) -> int | None:
    """The first of the best keys (by value, then id) the grammar accepts; None when none is, or
    when the accepted one ties with the last value looked at (an equal key may lie beyond)."""
    order = sorted(range(len(tokens)), key=lambda i: (-values[i], tokens[i]))
    for i in order:
        if values[i] == float("-inf"):  # the logits operations banned it and all below it
            return None
        if len(grammar.validate_tokens([tokens[i]])) == 1:
            return None if values[i] == values[order[-1]] else tokens[i]
    return None


def choose_again(logits: torch.Tensor, grammars: list[Any], temperatures: list[float], rejected: list[int],
                 width: int, candidates: int | None = None,
                 generator: torch.Generator | None = None,
                 masks: list[torch.Tensor | None] | None = None) -> list[tuple[int, str]]:
    """Per row of `logits` (processed, before the temperature; consumed), the token chosen under
    its grammar and how: "redrawn" (among the best keys) or "filled" (through the filled mask).
    `rejected`: each row's first token, which its grammar refused. `masks`: per row, its bitmask
    where already filled (the rows checked by their mask): such a row is settled by that mask
    alone, never by validate_tokens."""
    from ....structured.bitmask import token_ids_from_bitmask  # loaded after vLLM's worker started

    masks = masks if masks is not None else [None] * len(rejected)
    keys = race_keys(logits.float(), temperatures, generator)  # (vLLM-CPU's logits are float32 already: no copy)
    rows = range(len(rejected))
    first_keys = keys[rows, rejected].clone()
    keys[rows, rejected] = float("-inf")  # refused by validate_tokens: out of the candidates
    searched = [i for i in rows if masks[i] is None]
    chosen: list[tuple[int | None, str]] = [(None, "filled")] * len(rejected)
    if searched:
        top = keys[searched].topk(min(CANDIDATES if candidates is None else candidates, keys.shape[1]), dim=1)
        for i, v, t in zip(searched, top.values.tolist(), top.indices.tolist()):
            chosen[i] = (_first_allowed(grammars[i], v, t), "redrawn")
    missing = [i for i, (token, _) in enumerate(chosen) if token is None]
    if missing:
        # The mask decides, not validate_tokens: a grammar may refuse a token there that its mask
        # allows (llguidance's stopped matcher validates nothing, and its mask is the stop token).
        keys[missing, [rejected[i] for i in missing]] = first_keys[missing]
        unfilled = [i for i in missing if masks[i] is None]
        filled = dict(zip(unfilled, fill_masks([grammars[i] for i in unfilled], width))) if unfilled else {}
        bitmask = torch.stack([masks[i] if masks[i] is not None else filled[i] for i in missing])
        for i, allowed in zip(missing, token_ids_from_bitmask(bitmask, keys.shape[1])):
            kept = keys[i, allowed]  # (`allowed` ascends: argmax's first maximum is the lowest id, as torch's)
            # Nothing allowed survives the logits operations (e.g. allowed_token_ids disjoint from the
            # grammar): token 0, what vLLM's sampler returns for the all -inf masked row, so the request
            # ends as it would without this operation (its grammar refuses it).
            token = allowed[int(kept.argmax())] if len(allowed) and bool(torch.isfinite(kept).any()) else 0
            chosen[i] = (int(token), "filled")
    return chosen  # type: ignore[return-value]
