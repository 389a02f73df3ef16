"""Persistent-batch bookkeeping for logits processors: the BatchUpdateBuilder an engine fills each
step, the LogitsProcessors collection the sampler runs, and the helpers processors share (per-row
state dicts, the speculative-decoding row layout, -inf masks built from host-side index lists)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from ...backends.transfer import to_device
from ...checks import is_integer
from .interface import AddedRequest, BatchUpdate, LogitsProcessor, MoveDirectionality, MovedRequest

if TYPE_CHECKING:
    from ..params import SamplingParams

__all__ = ["BatchUpdateBuilder", "LogitsProcessors", "TokenMask", "TokenMaskProcessor", "process_dict_updates"]

T = TypeVar("T")


class BatchUpdateBuilder:
    """Collects one step's changes to the persistent batch, in vLLM's order of events: removals
    first (`removed_append`), then additions (which reuse the lowest freed index via
    `pop_removed`), then moves (condensing, reordering). `get_and_reset(batch_size)` hands the
    BatchUpdate to the processors (None when nothing changed)."""

    def __init__(self) -> None:
        self._removed: list[int] = []
        self._removed_sorted = False
        self.added: list[AddedRequest] = []
        self.moved: list[MovedRequest] = []
        self.batch_changed = False

    def _sort_removed(self) -> None:
        if not self._removed_sorted:
            self._removed.sort(reverse=True)  # lowest index last: pop() is the lowest
            self._removed_sorted = True

    @property
    def removed(self) -> list[int]:
        """Freed indices still empty, highest first. Reading it closes this step's removals."""
        self._sort_removed()
        return self._removed

    def removed_append(self, index: int) -> None:
        if self._removed_sorted:
            raise RuntimeError("a removal was registered after this step's removals were read; remove requests first")
        if not is_integer(index) or index < 0:
            raise ValueError(f"removed index must be an int >= 0, got {index!r}")
        self._removed.append(index)
        self.batch_changed = True

    def has_removed(self) -> bool:
        return bool(self._removed)

    def peek_removed(self) -> int | None:
        """The lowest freed index, or None."""
        if not self._removed:
            return None
        self._sort_removed()
        return self._removed[-1]

    def pop_removed(self) -> int | None:
        """Take the lowest freed index (a new request is placed there), or None."""
        if not self._removed:
            return None
        self._sort_removed()
        return self._removed.pop()

    def add(self, index: int, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> None:
        """Register a request placed at `index`; `output_ids` is the list the engine will append to."""
        if not is_integer(index) or index < 0:
            raise ValueError(f"added index must be an int >= 0, got {index!r}")
        if not isinstance(output_ids, list):
            raise ValueError(f"output_ids of the request added at {index} must be a list (appended to each step)")
        self.added.append((index, params, prompt_ids, output_ids))
        self.batch_changed = True

    def move(self, a: int, b: int, directionality: MoveDirectionality = MoveDirectionality.UNIDIRECTIONAL) -> None:
        for name, index in (("a", a), ("b", b)):
            if not is_integer(index) or index < 0:
                raise ValueError(f"move index {name} must be an int >= 0, got {index!r}")
        if not isinstance(directionality, MoveDirectionality):
            raise ValueError(f"directionality must be a MoveDirectionality, got {directionality!r}")
        self.moved.append((a, b, directionality))
        self.batch_changed = True

    def reset(self) -> bool:
        """Drop this step's changes; returns whether the batch changed."""
        changed = self.batch_changed
        self._removed, self.added, self.moved = [], [], []
        self._removed_sorted = False
        self.batch_changed = False
        return changed

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        if not (self._removed or self.added or self.moved):
            self.reset()
            return None
        update = BatchUpdate(batch_size=batch_size, removed=self.removed, added=self.added, moved=self.moved)
        self._removed, self.added, self.moved = [], [], []
        self._removed_sorted = False
        self.batch_changed = False
        return update


def process_dict_updates(
    entries: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None],
) -> bool:
    """Apply a BatchUpdate to per-row state kept in `entries` (index -> state, only for rows the
    processor acts on). `new_state(params, prompt_ids, output_ids)` returns a row's state, or None
    when the processor ignores that request. Returns whether `entries` changed."""
    if batch_update is None:
        return False
    changed = False
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            entries[index] = state
            changed = True
        elif entries.pop(index, None) is not None:
            changed = True
    if not entries:
        return changed
    for index in batch_update.removed:
        if entries.pop(index, None) is not None:
            changed = True
    for a, b, directionality in batch_update.moved:
        state_a = entries.pop(a, None)
        state_b = entries.pop(b, None)
        if state_a is not None:
            entries[b] = state_a
        if state_b is not None and directionality is MoveDirectionality.SWAP:
            entries[a] = state_b
        changed = changed or state_a is not None or state_b is not None
    return changed


def validate_added(batch_update: BatchUpdate | None, validate: Callable[[SamplingParams], None]) -> None:
    """Run `validate` on every added request's params before any state changes; errors name the row."""
    if batch_update is None:
        return
    for index, params, _, _ in batch_update.added:
        try:
            validate(params)
        except ValueError as err:
            raise ValueError(f"request added at row {index}: {err}") from None


class TokenMask:
    """Per-step masks built on the host as index lists and applied with one indexed write each:
    `banned` (row, token) pairs become -inf; `forced` rows allow exactly one token (its logit 0, so
    that even a token another mask removed stays sampleable)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._banned: tuple[torch.Tensor, torch.Tensor] | None = None
        self._forced: tuple[torch.Tensor, torch.Tensor] | None = None

    def set(self, banned: Iterable[tuple[int, int]], forced: Iterable[tuple[int, int]]) -> None:
        self._banned = self._upload(list(banned))
        self._forced = self._upload(list(forced))

    def _upload(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not pairs:
            return None
        both = to_device(torch.tensor(pairs, dtype=torch.int64).t().contiguous(), self.device)
        return both[0], both[1]

    @property
    def empty(self) -> bool:
        return self._banned is None and self._forced is None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # Scalars made with torch.full on the device: torch.tensor(x, device=...) would be a
        # blocking host-to-device copy.
        if self._banned is not None:
            logits.index_put_(self._banned, torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device))
        if self._forced is not None:
            rows, tokens = self._forced
            logits.index_fill_(0, rows, float("-inf"))
            logits.index_put_((rows, tokens), torch.zeros((), dtype=logits.dtype, device=logits.device))
        return logits


class TokenMaskProcessor(LogitsProcessor):
    """Base of the processors that ban tokens or force one token per row from per-request state
    (MinTokens, MultiSeq, ThinkMode): `_states` maps rows to state, `_mask` holds this step's mask."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._states: dict = {}
        self._mask = TokenMask(self.device)

    def is_argmax_invariant(self) -> bool:
        return False

    def validate_params(self, params: SamplingParams) -> None:
        params.verify(self.vocab_size)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return self._mask.apply(logits)

    def _apply_once(self, logits: torch.Tensor, banned: Iterable[tuple[int, int]], forced: Iterable[tuple[int, int]]) -> torch.Tensor:
        """Apply a one-off mask (speculative decoding) without touching this step's mask."""
        mask = TokenMask(self.device)
        mask.set(banned, forced)
        return mask.apply(logits)


class LogitsProcessors:
    """The processors a sampler runs, split as vLLM's sampler needs them: the non-argmax-invariant
    ones run on every batch, the argmax-invariant ones are skipped when every row is greedy."""

    def __init__(self, processors: Iterable[LogitsProcessor] = ()) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        for processor in processors:
            if not isinstance(processor, LogitsProcessor):
                raise ValueError(f"{type(processor).__name__} is not a LogitsProcessor")
            (self.argmax_invariant if processor.is_argmax_invariant() else self.non_argmax_invariant).append(processor)

    @property
    def all(self) -> list[LogitsProcessor]:
        return self.non_argmax_invariant + self.argmax_invariant

    def __iter__(self) -> Iterator[LogitsProcessor]:
        return iter(self.all)

    def __len__(self) -> int:
        return len(self.argmax_invariant) + len(self.non_argmax_invariant)

    def validate_params(self, params: SamplingParams) -> None:
        for processor in self.all:
            processor.validate_params(params)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Every processor follows the batch; added requests are validated by all of them first, so
        a bad request changes no processor's state."""
        validate_added(batch_update, self.validate_params)
        for processor in self.all:
            processor.update_state(batch_update)

    def apply_with_spec_decode(
        self,
        logits: torch.Tensor,
        num_draft_tokens: Sequence[int],
        draft_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Every processor, non-argmax-invariant first, on target logits laid out per draft position."""
        for processor in self.all:
            logits = processor.apply_with_spec_decode(logits, num_draft_tokens, draft_token_ids)
        return logits
