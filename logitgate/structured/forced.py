"""What a constraint fixes next: the tokens a decode step can propose without asking the model.

Two kinds, kept apart because they are not equally safe:

- mask-forced: the constraint's mask allows exactly one token (a tree's unique continuation, a
  grammar whose only way on is EOS). The constrained target samples that token with probability 1,
  so it may be committed without verification.
- string-forced: the grammar fixes the next *characters* (xgrammar's jump-forward string, e.g.
  `","age":` between two JSON values) but not their tokenization: the mask still allows other
  tokens (`"`, `",`, ...), and the model may pick one of them. The proposal (the canonical
  tokenization of the string) is a draft: it must be verified under the mask, like any draft.

`ForcedTokens.tokens` is mask-forced tokens first (`num_mask_forced` of them), then string-forced
ones; a mask-forced token after a string-forced one counts as string-forced (it is only forced if
the drafts before it are accepted). Callers commit `tokens[:num_mask_forced]` at most and verify
the rest.

No engine is imported at module level: the functions take the engine's matcher.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "LAST_TOKEN_RULES",
    "ForcedTokens",
    "llguidance_forced_tokens",
    "only_allowed_token",
    "xgrammar_forced_tokens",
]

Encode = Callable[[str], Sequence[int]]

# What to do with the last token of a forced string's tokenization when free text follows it:
# "keep" proposes it; "drop" leaves it to the model, because the canonical tokenization of the
# whole output may merge it with the free text (`":` + `"Vera` vs `":"` + `Vera`). Measured on
# the json_writer model's outputs (docs/benchmarks.md, logitgate/bench/forced_ceiling.py).
LAST_TOKEN_RULES = ("keep", "drop")
DEFAULT_LAST_TOKEN_RULE = "keep"


@dataclass(frozen=True)
class ForcedTokens:
    """Tokens to propose, in order; the first `num_mask_forced` are forced by the mask alone (safe
    to commit unverified), the rest are string-forced drafts (verify them under the mask)."""

    tokens: list[int] = field(default_factory=list)
    num_mask_forced: int = 0
    # A mask was filled where the grammar may end and allowed several tokens: this grammar can end
    # at free states, so asking it for mask-forced tokens costs a fill a step (callers may stop).
    ends_free: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.num_mask_forced <= len(self.tokens):
            raise ValueError(f"num_mask_forced={self.num_mask_forced} is outside [0, {len(self.tokens)}]")

    @property
    def mask_forced(self) -> list[int]:
        return self.tokens[: self.num_mask_forced]

    @property
    def string_forced(self) -> list[int]:
        return self.tokens[self.num_mask_forced :]

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, max_tokens: int) -> ForcedTokens:
        """The first max_tokens of them (the mask-forced count cut with them)."""
        n = max(0, max_tokens)
        return ForcedTokens(self.tokens[:n], min(self.num_mask_forced, n), self.ends_free)

    @classmethod
    def all_mask_forced(cls, tokens: Sequence[int]) -> ForcedTokens:
        """A unique continuation (TreeDFA.forced_tokens): every token is mask-forced."""
        tokens = [int(t) for t in tokens]
        return cls(tokens, len(tokens))


def only_allowed_token(bitmask_row: Any, vocab_size: int) -> int | None:
    """The token a bitmask row (int32 words, vLLM/xgrammar layout) allows alone, or None when it
    allows zero or several."""
    words = np.asarray(bitmask_row, dtype=np.int32).view(np.uint32)
    nonzero = np.flatnonzero(words)
    if len(nonzero) != 1:
        return None
    word = int(words[nonzero[0]])
    if word & (word - 1):  # more than one bit
        return None
    token = int(nonzero[0]) * 32 + word.bit_length() - 1
    return token if token < vocab_size else None


def _xgrammar_only_allowed(matcher: Any, vocab_size: int, scratch: Any) -> int | None:
    matcher.fill_next_token_bitmask(scratch, 0)
    return only_allowed_token(scratch[0].numpy(), vocab_size)


def xgrammar_forced_tokens(
    matcher: Any,
    encode: Encode | None,
    max_tokens: int,
    *,
    vocab_size: int | None = None,
    last_token: str = DEFAULT_LAST_TOKEN_RULE,
) -> ForcedTokens:
    """What an `xgrammar.GrammarMatcher` fixes next, at most max_tokens tokens; the matcher is
    left as it was.

    encode: str -> token ids without special tokens (the model's tokenizer); it tokenizes
    `matcher.find_jump_forward_string()` into the string-forced proposal (None: no string-forced
    tokens). vocab_size: the matcher's vocabulary size, needed to find mask-forced tokens (one
    mask fill where no string is fixed and the grammar may end; None: none is reported
    mask-forced, which is safe).
    last_token: LAST_TOKEN_RULES. Every returned token was accepted by the matcher in sequence
    (accept, then rollback), so a tokenization the grammar refuses is cut where it is refused.
    """
    if last_token not in LAST_TOKEN_RULES:
        raise ValueError(f"last_token must be one of {LAST_TOKEN_RULES}, got {last_token!r}")
    if max_tokens <= 0 or matcher.is_terminated():
        return ForcedTokens()
    scratch = None
    tokens: list[int] = []
    num_mask_forced = 0
    string_seen = ends_free = False
    try:
        while len(tokens) < max_tokens and not matcher.is_terminated():
            text = matcher.find_jump_forward_string() if encode is not None else ""
            if not text:
                # No fixed string: where the grammar may end, the mask may allow one token (the stop
                # token after a closed JSON object). The mask is filled only there (a fill costs
                # about what the step's own mask does): a token inside a fixed string that the mask
                # allows alone is proposed as string-forced, which is safe (verified, accepted w.p.
                # 1), and a single allowed token elsewhere is left to the model.
                if vocab_size is None or not matcher.is_completed():
                    break
                if scratch is None:
                    import xgrammar as xgr

                    scratch = xgr.allocate_token_bitmask(1, vocab_size)
                single = _xgrammar_only_allowed(matcher, vocab_size, scratch)
                ends_free = single is None
                if single is None or not matcher.accept_token(single):
                    break
                tokens.append(single)
                num_mask_forced += not string_seen
                continue
            ids = [int(t) for t in encode(text)]
            dropped = last_token == "drop" and bool(ids)
            if dropped:
                ids.pop()
            taken = 0
            for token in ids[: max_tokens - len(tokens)]:
                if not matcher.accept_token(token):
                    break
                taken += 1
            tokens.extend(ids[:taken])
            string_seen = string_seen or taken > 0
            if dropped or taken < len(ids) or taken == 0:
                break  # the rest of the string is left to the model (cut, refused or capped)
    finally:
        if tokens:
            matcher.rollback(len(tokens))
    return ForcedTokens(tokens, num_mask_forced, ends_free)


def llguidance_forced_tokens(matcher: Any, max_tokens: int) -> ForcedTokens:
    """What an `llguidance.LLMatcher` fixes next: its fast-forward tokens (compute_ff_tokens, the
    tokenization llguidance proposes for the forced bytes, which already leaves out a last token
    the text that follows could extend), at most max_tokens. All string-forced: llguidance does
    not say whether its mask allows them alone, so they are verified as drafts."""
    if max_tokens <= 0 or matcher.is_stopped() or matcher.is_error():
        return ForcedTokens()
    tokens = [int(t) for t in matcher.compute_ff_tokens()][:max_tokens]
    valid = matcher.validate_tokens(tokens) if tokens else 0
    return ForcedTokens(tokens[:valid], 0)
