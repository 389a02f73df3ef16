"""TreeCursor: one request's position in a TreeDFA, written once for every route: the grammar backend
and vLLM's structured-output route (`TreeGrammar`), the decode loop (`TreeConstraint`), and the
logits processors that follow an engine's output list (`Tree`, the Model Runner V2 processor).

A cursor keeps the states it visited (the root first), so it can roll back, and counts the tokens
it took, so it can follow an output that grows and sometimes shrinks. It takes tokens in two ways:

- `commit` (RTP-LLM's semantics, for tokens already decided: sampled under the tree's mask, or an
  engine's output): every token moves; a token the state does not allow leads to the error state,
  whose only token is the end token; finished states never change.
- `accept` / `validate` (a grammar's semantics, for tokens proposed: drafts, vLLM's scheduler): a
  token is taken only when the state allows it and the cursor has not finished; `accept` takes all
  or nothing.

Names: `TreeDFA.advance` moves a batch of states (tensors) one token each; `TreeDFA.walk` and
`walk_states` follow tokens from a state without keeping anything; a cursor `commit`s them.

The trees are immutable, so each state's allowed set is memoised once per tree, shared by all cursors.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ..forced import ForcedTokens

__all__ = ["TreeCursor"]

_allowed_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _allowed_sets(tree: Any) -> dict[int, frozenset[int]]:
    """The memo of `tree`'s allowed sets by state (filled as cursors ask)."""
    memo = _allowed_memo.get(tree)
    if memo is None:
        memo = _allowed_memo.setdefault(tree, {})
    return memo


class TreeCursor:
    """One request's position in a TreeDFA and the states before it, from `state` (default the root)."""

    __slots__ = ("tree", "_states", "_allowed")

    def __init__(self, tree: Any, state: int | None = None) -> None:
        self.tree = tree
        self._states: list[int] = [tree.root if state is None else state]
        self._allowed = _allowed_sets(tree)

    @property
    def state(self) -> int:
        return self._states[-1]

    @property
    def num_tokens(self) -> int:
        """Tokens taken since the cursor began (or was reset)."""
        return len(self._states) - 1

    def allows(self, state: int, token: int) -> bool:
        allowed = self._allowed.get(state)
        if allowed is None:
            allowed = self._allowed[state] = frozenset(self.tree.allowed(state))
        return token in allowed

    # ---- decided tokens (RTP-LLM semantics: every token moves) ----

    def commit(self, tokens: Sequence[int]) -> None:
        """Take `tokens`, already decided (TreeDFA.step: an unknown token leads to the error state)."""
        tree, state = self.tree, self._states[-1]
        for token in tokens:
            state = tree.step(state, token)
            self._states.append(state)

    def walk_states(self, tokens: Sequence[int], vocab_size: int | None = None) -> list[int]:
        """The state before each token and after the last (1 + len(tokens) states), as `commit`
        would visit them; nothing taken. With `vocab_size`, a token outside [0, vocab_size) (an
        engine's placeholder draft) leads to the error state instead of raising."""
        tree, states = self.tree, [self._states[-1]]
        for token in tokens:
            if vocab_size is not None and not 0 <= token < vocab_size:
                states.append(tree.error_state)
            else:
                states.append(tree.step(states[-1], token))
        return states

    def catch_up(self, length: int, read: Callable[[int, int], Sequence[int]]) -> None:
        """Follow an output whose first `length` tokens are final: `read(start, end)` gives its
        tokens [start, end). Tokens past those already taken are committed; an output shorter than
        the cursor (the engine dropped or preempted tokens) is replayed from the root."""
        if length < self.num_tokens:
            self.reset()
        if length > self.num_tokens:
            self.commit(read(self.num_tokens, length))

    def follow(self, output_ids: Sequence[int]) -> None:
        """`catch_up` with an output-token list held by reference (an engine's own list), whose
        final tokens end at the first -1 (an async-scheduling placeholder, filled before sampling)."""
        start = self.num_tokens if len(output_ids) >= self.num_tokens else 0
        end = start
        while end < len(output_ids) and output_ids[end] >= 0:
            end += 1
        self.catch_up(end, lambda a, b: output_ids[a:b])

    # ---- proposed tokens (grammar semantics: only allowed tokens, nothing after the end) ----

    def _take(self, tokens: Sequence[int]) -> list[int]:
        """The states after each token the cursor would accept, stopping at the first it would not."""
        tree, state, visited = self.tree, self._states[-1], []
        for token in tokens:
            token = int(token)
            if tree.is_finished(state) or not self.allows(state, token):
                break
            state = tree.step(state, token)
            visited.append(state)
        return visited

    def accept(self, tokens: Sequence[int]) -> bool:
        """Take `tokens` if the cursor accepts every one; otherwise take none and return False."""
        visited = self._take(tokens)
        if len(visited) != len(tokens):
            return False
        self._states.extend(visited)
        return True

    def accepted_prefix(self, tokens: Sequence[int]) -> list[int]:
        """The longest prefix of `tokens` `accept` would take (nothing after the end token); nothing
        taken. (valid_prefix, below, is the decode loop's draft check: it counts allowed tokens.)"""
        return [int(t) for t in tokens[: len(self._take(tokens))]]

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` lead, one by one, through allowed tokens (the decode loop's draft
        check: a finished state allows its end token, as TreeDFA.allowed says); nothing taken."""
        state = self._states[-1]
        for i, token in enumerate(tokens):
            if not self.allows(state, token):
                return i
            state = self.tree.step(state, token)
        return len(tokens)

    def end_of(self, tokens: Sequence[int]) -> int | None:
        """How many of `tokens` lead up to and include the one that finishes the tree (0 when it is
        already finished), or None when it does not finish within them; nothing taken."""
        tree, state = self.tree, self._states[-1]
        for i, token in enumerate(tokens):
            if tree.is_finished(state):
                return i
            state = tree.step(state, token)
        return len(tokens) if tree.is_finished(state) else None

    # ---- position ----

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` tokens taken; ValueError for more than were taken."""
        if not 0 <= num_tokens < len(self._states):
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {len(self._states) - 1} were accepted")
        if num_tokens:
            del self._states[-num_tokens:]

    def reset(self) -> None:
        """Back to where the cursor began."""
        del self._states[1:]

    def fork(self) -> TreeCursor:
        """An independent copy at the same position, history included (beams, n > 1)."""
        twin = type(self).__new__(type(self))
        twin.tree, twin._states, twin._allowed = self.tree, list(self._states), self._allowed
        return twin

    def is_terminated(self) -> bool:
        return bool(self.tree.is_finished(self._states[-1]))

    def forced_tokens(self, max_len: int) -> list[int]:
        """The unique continuation from here (TreeDFA.forced_tokens); [] for max_len <= 0."""
        return self.tree.forced_tokens(self._states[-1], max_len) if max_len > 0 else []

    def forced(self, max_tokens: int, encode=None) -> ForcedTokens:
        """forced_tokens as structured/forced.py's ForcedTokens: all mask-forced (the tree's mask
        allows each alone). `encode` is unused (a tree fixes tokens, not strings)."""
        return ForcedTokens.all_mask_forced(self.forced_tokens(max_tokens))
