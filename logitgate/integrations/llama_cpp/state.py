"""Per-generation constraint state, kept in step with the tokens generated so far.

A tracker knows the constraint's state after a list of generated tokens and moves to another list
by undoing back to the common prefix and stepping forward (speculative drafts that were rejected,
a new generation with the same prompt): the state is a function of the tokens, never of the
order of calls. Trees step on the host through `TreeDFA.step` and mask with logitgate's tree
kernel (`keep_only_allowed`); grammars are logitgate's xgrammar grammars (fill the bitmask,
`apply_token_bitmask_inplace`, roll back)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...structured.bitmask import apply_token_bitmask_inplace, bitmask_from_token_ids
from ...structured.forced import ForcedTokens
from ...structured.tree import TreeDFA
from ...structured.tree.candidates import keep_only_allowed


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class TreeTracker:
    """A position in a TreeDFA."""

    def __init__(self, tree: TreeDFA) -> None:
        self.tree = tree
        self.tokens: list[int] = []
        self._states = [tree.root]  # state after tokens[:i]

    @property
    def state(self) -> int:
        return self._states[-1]

    def sync(self, tokens: Sequence[int]) -> None:
        keep = _common_prefix(self.tokens, tokens)
        del self.tokens[keep:], self._states[keep + 1 :]
        for token in tokens[keep:]:
            self._states.append(self.tree.step(self._states[-1], int(token)))
            self.tokens.append(int(token))

    def allowed(self) -> list[int]:
        return self.tree.allowed(self.state)

    def mask(self, scores: np.ndarray) -> None:
        """In place: every token the tree does not allow next gets -inf."""
        states = torch.tensor([self.state], dtype=torch.int64)
        keep_only_allowed(self.tree, torch.from_numpy(scores).view(1, -1), states)

    def forced_tokens(self, max_len: int) -> list[int]:
        return self.tree.forced_tokens(self.state, max_len)

    def forced(self, max_len: int, encode: Any = None) -> ForcedTokens:
        """forced_tokens, all mask-forced (a tree fixes tokens, not strings: `encode` is unused)."""
        return ForcedTokens.all_mask_forced(self.forced_tokens(max_len))

    def is_finished(self) -> bool:
        return self.tree.is_finished(self.state)


class GrammarTracker:
    """A grammar's matcher (logitgate's XGrammarGrammar) after the generated tokens."""

    def __init__(self, grammar: Any, backend: Any, stop_token_ids: Sequence[int]) -> None:
        self.grammar = grammar
        self.backend = backend
        self.tokens: list[int] = []
        self._stops = frozenset(int(t) for t in stop_token_ids)
        self._bitmask = backend.allocate_token_bitmask(1)
        self._stop_row = bitmask_from_token_ids([sorted(self._stops)], backend.vocab_size)[0]
        self._accepted = 0  # tokens[:_accepted] are in the grammar's state
        self._rejected = False  # tokens[_accepted] was refused: only the stop tokens follow

    def sync(self, tokens: Sequence[int]) -> None:
        keep = _common_prefix(self.tokens, tokens)
        if keep < self._accepted:
            self.grammar.rollback(self._accepted - keep)
            self._accepted = keep
        if keep <= self._accepted:  # a refused token, if any, is gone
            self._rejected = False
        del self.tokens[keep:]
        for token in tokens[keep:]:
            if not self._rejected and not self.grammar.is_terminated():
                if self.grammar.accept_tokens((int(token),)):
                    self._accepted += 1
                else:
                    self._rejected = True
            self.tokens.append(int(token))

    def _fill(self) -> np.ndarray:
        if self._rejected or self.grammar.is_terminated():
            self._bitmask[0] = self._stop_row
        else:
            self.backend.fill_bitmasks([self.grammar], self._bitmask, [0])
        return self._bitmask[0].numpy()

    def allowed(self) -> list[int]:
        words = self._fill().view(np.uint32)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        return np.flatnonzero(bits[: self.backend.vocab_size]).tolist()

    def mask(self, scores: np.ndarray) -> None:
        self._fill()
        vocab = min(len(scores), self.backend.vocab_size)
        apply_token_bitmask_inplace(torch.from_numpy(scores).view(1, -1), self._bitmask, vocab_size=vocab)
        scores[vocab:] = -np.inf

    def forced_tokens(self, max_len: int) -> list[int]:
        """While exactly one token is allowed, that token (accepted here, so the caller's next sync
        with the tokens including them is free); stops after a stop token."""
        out: list[int] = []
        while len(out) < max_len and not self._rejected and not self.grammar.is_terminated():
            words = self._fill()
            nonzero = np.flatnonzero(words)
            if len(nonzero) != 1:
                break
            word = int(words[nonzero[0]]) & 0xFFFFFFFF
            if word & (word - 1):
                break
            token = int(nonzero[0]) * 32 + word.bit_length() - 1
            self.grammar.accept_tokens((token,))
            self._accepted += 1
            self.tokens.append(token)
            out.append(token)
        return out

    def forced(self, max_len: int, encode: Any = None) -> ForcedTokens:
        """What the grammar fixes next (structured/forced.py): mask-forced tokens and the
        tokenization `encode` gives of its fixed string (drafts the caller verifies)."""
        if self._rejected:
            return ForcedTokens()
        return self.grammar.forced(max_len, encode)

    def is_finished(self) -> bool:
        return self.grammar.is_terminated()
