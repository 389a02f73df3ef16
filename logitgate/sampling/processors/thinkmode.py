"""ThinkMode (RTP-LLM's ThinkModeLogitsProcessor): a thinking budget for reasoning models.

A request with `max_thinking_tokens` set goes through three phases: before thinking (the model may
open it with the begin-think token), thinking, and after thinking. Once it has generated
`max_thinking_tokens` thinking tokens, the end-of-think sequence is forced one token per step,
continuing from any part of it the model already emitted (a string-contains automaton tracks the
longest emitted prefix). Outside their phase the begin/end-think tokens are masked: no end before a
beginning, no second beginning, no second end.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ...structured.reasoning import EndMarker
from ..params import SamplingParams
from .interface import BatchUpdate
from .spec_layout import SpecDecodeLayout
from .state import TokenMaskProcessor, process_dict_updates, validate_added

__all__ = ["ThinkMode"]

BEFORE, THINKING, AFTER = 0, 1, 2


class _ThinkState:
    __slots__ = ("budget", "consumed", "matched", "output_ids", "phase", "spent")

    def __init__(self, phase: int, budget: int, matched: int, output_ids: list[int]) -> None:
        self.phase = phase
        self.budget = budget
        self.spent = 0  # thinking tokens generated
        self.matched = matched  # longest suffix of the thinking text that is a prefix of the end sequence
        self.output_ids = output_ids
        self.consumed = 0

    def copy(self) -> _ThinkState:
        twin = _ThinkState(self.phase, self.budget, self.matched, self.output_ids)
        twin.spent, twin.consumed = self.spent, self.consumed
        return twin


class ThinkMode(TokenMaskProcessor):
    """Enforce each request's `max_thinking_tokens` (requests without one are left alone).

    end_think_token_ids: the sequence forced when the budget is spent (e.g. the ids of
    "\\n</think>\\n\\n"); end_think_token_id: the token that marks the end of thinking (masked outside
    thinking; defaults to the sequence's only token); begin_think_token_id: the token that opens
    thinking, or None when the chat template always opens it in the prompt.
    The phase a request starts in comes from its prompt: after the last begin-think token with no
    end-think token after it: thinking; after an end-think token: after; otherwise before (thinking
    when begin_think_token_id is None). The budget counts generated tokens while thinking, forced
    ones included; the forced sequence completes the thinking even past the budget.
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str = "cpu",
        *,
        end_think_token_ids: Sequence[int],
        end_think_token_id: int | None = None,
        begin_think_token_id: int | None = None,
    ) -> None:
        sequence = [int(t) for t in end_think_token_ids]
        if not sequence:
            raise ValueError("end_think_token_ids must hold at least one token id")
        for t in sequence + [x for x in (end_think_token_id, begin_think_token_id) if x is not None]:
            if not 0 <= t < vocab_size:
                raise ValueError(f"think token id {t} is outside the vocabulary [0, {vocab_size})")
        if end_think_token_id is None:
            if len(sequence) != 1:
                raise ValueError("end_think_token_id is required when end_think_token_ids has several tokens: which one ends thinking?")
            end_think_token_id = sequence[0]
        if end_think_token_id not in sequence:
            raise ValueError(f"end_think_token_id {end_think_token_id} is not in end_think_token_ids {sequence}")
        if begin_think_token_id is not None and begin_think_token_id in sequence:
            raise ValueError(f"begin_think_token_id {begin_think_token_id} is also in end_think_token_ids")
        super().__init__(vocab_size, device)
        self.sequence = sequence
        self.end_token = end_think_token_id
        self.begin_token = begin_think_token_id
        self._end_marker = EndMarker(sequence)  # the end-of-think sequence, matched incrementally

    # ---- the automaton ----

    def _step(self, state: _ThinkState, token: int) -> None:
        if state.phase == BEFORE:
            if token == self.begin_token:
                state.phase, state.spent, state.matched = THINKING, 0, 0
        elif state.phase == THINKING:
            forcing = state.spent >= state.budget
            state.spent += 1
            state.matched = self._end_marker.step(state.matched, token)
            # The model may close thinking itself before the budget; a forced sequence runs to its end.
            if state.matched == len(self.sequence) or (token == self.end_token and not forcing):
                state.phase = AFTER

    def _masks(self, state: _ThinkState, row: int, banned: list, forced: list) -> None:
        if state.phase == THINKING and state.spent >= state.budget:
            forced.append((row, self.sequence[state.matched]))
            return
        if state.phase != THINKING:
            banned.append((row, self.end_token))
        if state.phase != BEFORE and self.begin_token is not None:
            banned.append((row, self.begin_token))

    def _new_state(self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> _ThinkState | None:
        if params.max_thinking_tokens is None:
            return None
        prompt = list(prompt_ids or [])
        if self.begin_token is None:
            return _ThinkState(THINKING, params.max_thinking_tokens, 0, output_ids)
        last_begin = max((i for i, t in enumerate(prompt) if t == self.begin_token), default=-1)
        last_end = max((i for i, t in enumerate(prompt) if t == self.end_token), default=-1)
        if last_begin < 0:
            return _ThinkState(BEFORE, params.max_thinking_tokens, 0, output_ids)
        if last_end > last_begin:
            return _ThinkState(AFTER, params.max_thinking_tokens, 0, output_ids)
        # Thinking was opened in the prompt; prompt tokens after the opening may already start the end sequence.
        matched = 0
        for token in prompt[last_begin + 1 :]:
            matched = self._end_marker.step(matched, token)
        return _ThinkState(THINKING, params.max_thinking_tokens, matched, output_ids)

    # ---- the processor ----

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        validate_added(batch_update, self.validate_params)
        process_dict_updates(self._states, batch_update, self._new_state)
        banned: list[tuple[int, int]] = []
        forced: list[tuple[int, int]] = []
        for index, state in self._states.items():
            for token in state.output_ids[state.consumed :]:
                self._step(state, token)
            state.consumed = len(state.output_ids)
            self._masks(state, index, banned, forced)
        self._mask.set(banned, forced)

    def apply_with_spec_decode(self, logits, num_draft_tokens, draft_token_ids=None) -> torch.Tensor:
        layout = SpecDecodeLayout(num_draft_tokens, logits.shape[0], draft_token_ids)
        banned: list[tuple[int, int]] = []
        forced: list[tuple[int, int]] = []
        for index, state in self._states.items():
            drafts = layout.drafts(index, "ThinkMode")
            ahead = state.copy()
            for position, row in enumerate(layout.rows_of(index)):
                self._masks(ahead, row, banned, forced)
                if position < len(drafts):
                    self._step(ahead, drafts[position])
        return self._apply_once(logits, banned, forced)

    def phase(self, index: int) -> str | None:
        """'before', 'thinking' or 'after' for the request at row `index` (None if it has no budget)."""
        state = self._states.get(index)
        return None if state is None else ("before", "thinking", "after")[state.phase]
