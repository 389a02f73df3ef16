"""The logits processor llama-cpp-python calls (`logits_processor=` of `create_completion`,
`create_chat_completion`, `generate`, `sample`), with the token-trie sampler's semantics:

- mode "greedy": inside the span only the best allowed token keeps its logit (argmax over the
  valid set, whatever the sampler settings); mode "sampled": every allowed token keeps its logit
  and llama.cpp's own temperature / top-k / top-p / min-p then act on the valid set only.
- span: with `marker`, generation starts free and the constraint starts right after the generated
  text ends with the marker; it ends when the path is complete and only the end token could follow
  (the end token is then not forced and generation goes on free), and starts again at the next
  marker. Without a marker the whole completion is constrained and the end token is forced at a
  path's end.

State is per generation and derived from the generated tokens (`state.py`): a call for an earlier
position (llama-cpp-python verifying drafts, see `drafts.py`) rolls back, a repeated prompt starts
over. llama-cpp-python calls processors from a C callback that swallows exceptions (and then
passes the logits on unmasked), so nothing may escape a call: the first error of any kind is kept
in `.error` and logged once, and from then on every call of this processor only narrows what the
logits allow (`refuse`: stop tokens only, the generation ends). Scores or input ids that do not
fit the model the constraint was compiled for (another model's) fail the first call, before the
first token; their stop tokens are unknown here, so such a call keeps no token at all.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...structured.forced import ForcedTokens
from .drafts import register
from .model import LlamaModelInfo

logger = logging.getLogger(__name__)

MODES = ("greedy", "sampled")


def refuse(scores: Any, stops: np.ndarray, vocab_size: int) -> np.ndarray:
    """The fallback of a failed call, which cannot fail itself: every logit -inf but the stop tokens'
    (their own values, so it only narrows what the logits allow). Scores of another width are
    another model's, whose stop tokens are unknown here: nothing is kept. Never the logits unmasked:
    llama-cpp-python's C callback would pass them on if this raised."""
    try:
        out = np.full(len(scores), -np.inf, dtype=np.float32)
        if len(out) == vocab_size:
            keep = stops[(stops >= 0) & (stops < len(out))]
            out[keep] = np.asarray(scores, dtype=np.float32)[keep]
        return out
    except BaseException:  # noqa: BLE001 - not an array of floats: narrow it in place, keeping nothing
        try:
            scores[...] = -np.inf
        except BaseException:  # noqa: BLE001
            pass
        return scores


class _Span:
    __slots__ = ("start", "end")

    def __init__(self, start: int) -> None:
        self.start = start  # index of the first constrained generated token
        self.end: int | None = None  # index after the last one, once the span is over


class LlamaLogitsProcessor:
    """One generation's constraint state; call it as llama-cpp-python does: (input_ids, scores) ->
    scores. Make one per generation with `LlamaConstraint.logits_processor()`."""

    def __init__(self, constraint: Any) -> None:
        self.constraint = constraint
        self.info: LlamaModelInfo = constraint.info
        self.error: BaseException | None = None  # the first failure: the generation ends (stop tokens only)
        vocab = self.info.vocab_size
        # Computed here, outside llama-cpp-python's callback, so the fallback only reads an array.
        self._stops = np.array(sorted({t for t in self.info.stop_token_ids if 0 <= t < vocab}), dtype=np.intp)
        self._model_name = min(self.info.model_ids, default="the model")
        self._tracker = constraint.new_tracker()
        self._prompt: np.ndarray | None = None
        self._draft_base: int | None = None  # set by TreeDrafts: the next calls sample base + 0, 1, ...
        self._draft_calls = 0
        self._draft_limit = 0
        self.calls = 0
        self.reset()

    def reset(self) -> None:
        """Forget the generation: the next call's input is a new prompt."""
        self._prompt = None
        self._explicit = False  # begin() was called: the caller says where the prompt ends
        self._last_pos = -1
        self._gen: list[int] = []
        self._spans: list[_Span] = [] if self.constraint.marker is not None else [_Span(0)]
        self._draft_base = None
        self._tracker.sync([])

    def begin(self, prompt: Sequence[int]) -> None:
        """Start a generation after `prompt` (for loops that drive the model themselves)."""
        self.reset()
        self._prompt = np.asarray(prompt, dtype=np.intc).copy()
        self._explicit = True

    # -- positions ----------------------------------------------------------------------------

    def expect_drafts(self, base: int, num_drafts: int) -> None:
        """Called by TreeDrafts: llama-cpp-python evaluates the input (length `base`) plus
        `num_drafts` drafts, then samples positions base - 1, base, ... one call each."""
        self._draft_base, self._draft_calls, self._draft_limit = base, 0, base + num_drafts

    def _position(self, input_ids: np.ndarray) -> tuple[int, bool]:
        """How many of `input_ids` precede the token being sampled, and whether a draft told."""
        n = len(input_ids)
        base = self._draft_base
        if base is not None and base <= n <= self._draft_limit:
            pos = base + self._draft_calls
            self._draft_calls += 1
            if pos <= n:
                return pos, True
        self._draft_base = None
        return n, False

    def _generated(self, input_ids: np.ndarray) -> list[int]:
        pos, drafted = self._position(input_ids)
        prompt = self._prompt
        # Without drafts llama-cpp-python's loop calls once per token: any other step is a new
        # generation (say, a new prompt that extends the last one), unless begin() was called.
        stepped = drafted or self._explicit or pos == self._last_pos + 1
        if prompt is None or not stepped or pos < len(prompt) or not np.array_equal(input_ids[: len(prompt)], prompt):
            # A new generation: its first call samples after the whole input (a stale draft position
            # of an earlier generation does not apply).
            self.reset()
            pos = len(input_ids)
            self._prompt = prompt = np.array(input_ids, dtype=np.intc)
            self._check_ids(prompt)
            if self.constraint.tree_start is not None and (not pos or int(prompt[-1]) != self.constraint.tree_start):
                logger.warning(
                    "the prompt does not end with the tree's start token %d (last prompt token: %s); "
                    "the tree starts after it", self.constraint.tree_start, int(prompt[-1]) if pos else None,
                )
        self._last_pos = pos
        return [int(t) for t in input_ids[len(prompt) : pos]]

    def _check_ids(self, prompt: np.ndarray) -> None:
        vocab = self.info.vocab_size
        bad = prompt[(prompt < 0) | (prompt >= vocab)]
        if len(bad):
            raise ValueError(
                f"the input has token id {int(bad[0])}, outside {self._model_name}'s vocabulary [0, {vocab}): "
                "this processor was compiled for another model (build one with constrain(llm, ...) for each Llama)"
            )

    # -- state ----------------------------------------------------------------------------------

    def _sync(self, gen: list[int]) -> None:
        """Move to the state after the generated tokens `gen` (undoing to the common prefix)."""
        keep = 0
        old = self._gen
        limit = min(len(old), len(gen))
        while keep < limit and old[keep] == gen[keep]:
            keep += 1
        spans = self._spans
        if self.constraint.marker is not None:
            while spans and spans[-1].start > keep:
                spans.pop()
        if spans and spans[-1].end is not None and spans[-1].end > keep:
            spans[-1].end = None
        del old[keep:]
        for token in gen[keep:]:
            old.append(token)
            span = spans[-1] if spans else None
            if span is not None and span.end is None:
                self._tracker.sync(old[span.start :])
                if self._span_over():
                    span.end = len(old)
            elif self._marker_at_end(span.end if span is not None else 0):
                spans.append(_Span(len(old)))
        span = spans[-1] if spans else None
        if span is not None and span.end is None:
            self._tracker.sync(old[span.start :])

    def _span_over(self) -> bool:
        if self._tracker.is_finished():
            return True
        if self.constraint.marker is None:
            return False
        return set(self._tracker.allowed()) <= self.constraint.end_ids

    def _marker_at_end(self, since: int) -> bool:
        """Whether the free text generated from index `since` ends with the marker."""
        marker, gen = self.constraint.marker, self._gen
        if isinstance(marker, tuple):
            return len(gen) - since >= len(marker) and tuple(gen[len(gen) - len(marker) :]) == marker
        tail, i = b"", len(gen)
        while i > since and len(tail) < len(marker):
            i -= 1
            tail = self.info.token_bytes(gen[i]) + tail
        return tail.endswith(marker)

    @property
    def in_span(self) -> bool:
        return bool(self._spans) and self._spans[-1].end is None

    # -- the calls ----------------------------------------------------------------------------

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        self.calls += 1
        if self.error is None:
            try:
                return self._constrained(input_ids, scores)
            except BaseException as exc:  # noqa: BLE001 - the C callback would swallow it and pass the logits on
                self._failed(exc)
        return refuse(scores, self._stops, self.info.vocab_size)

    def _constrained(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        register(self)
        if len(scores) != self.info.vocab_size:
            raise ValueError(
                f"scores have {len(scores)} entries but {self._model_name} has a vocabulary of "
                f"{self.info.vocab_size}: this processor was compiled for another model (build one with "
                "constrain(llm, ...) for each Llama)"
            )
        out = np.array(scores, dtype=np.float32)  # contiguous copy: llama-cpp-python passes a strided view
        self._sync(self._generated(np.asarray(input_ids)))
        if self.in_span:
            self._tracker.mask(out)
            if self.constraint.mode == "greedy":
                best = int(np.argmax(out))
                value = out[best]
                out.fill(-np.inf)
                out[best] = value
        return out

    def _failed(self, exc: BaseException) -> None:
        """Keep the first error; from now on every call allows only the stop tokens."""
        self.error = exc
        try:
            logger.error("logitgate constraint failed, ending the generation (only stop tokens from now on): %s",
                         exc, exc_info=exc)
        except BaseException:  # noqa: BLE001 - logging must not undo the refusal
            pass

    def valid_drafts(self, input_ids: np.ndarray, drafts: Sequence[int]) -> int:
        """How many leading `drafts` the constraint allows after `input_ids` (the generated part
        after this generation's prompt). None after a failure: only stop tokens follow."""
        if self.error is not None:
            return 0
        if self._prompt is None:
            return len(drafts)
        base = [int(t) for t in input_ids[len(self._prompt) :]]
        for i, token in enumerate(drafts):
            self._sync(base + [int(t) for t in drafts[:i]])
            if self.in_span and int(token) not in set(self._tracker.allowed()):
                return i
        return len(drafts)

    def forced(self, generated: Sequence[int], max_len: int) -> ForcedTokens:
        """What the constraint fixes after `generated` (structured/forced.py), at most `max_len`:
        mask-forced tokens (forced_tokens) then, for a grammar, the llama.cpp tokenization of the
        string it fixes as drafts to verify. None outside a span; with a marker, nothing from the
        end token on."""
        self._sync([int(t) for t in generated])
        if not self.in_span or max_len <= 0:
            return ForcedTokens()
        forced = self._tracker.forced(max_len, self._encode)
        if self.constraint.marker is not None:
            end = next((i for i, t in enumerate(forced.tokens) if t in self.constraint.end_ids), None)
            if end is not None:
                forced = forced.cut(end)
        return forced

    def _encode(self, text: str) -> list[int]:
        return self.info.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    def forced_tokens(self, generated: Sequence[int], max_len: int) -> list[int]:
        """The tokens the constraint forces after `generated` (its unique continuation inside the
        span), at most `max_len`; none outside a span. With a marker the end token is never
        forced (the span ends before it)."""
        self._sync([int(t) for t in generated])
        if not self.in_span or max_len <= 0:
            return []
        forced = self._tracker.forced_tokens(max_len)
        if self.constraint.marker is not None:
            for i, token in enumerate(forced):
                if token in self.constraint.end_ids:
                    return forced[:i]
        return forced
