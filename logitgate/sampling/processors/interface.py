"""vLLM v1's logits-processor programming model: batch-level state updates plus `apply(logits)`.

Each engine step the engine calls `update_state(batch_update)` on every processor (None when the
persistent batch did not change), then `apply(logits)`. `AddedRequest` carries the request's
output-token list by reference: the engine appends sampled tokens to that same list, so processors
that count or inspect generated tokens read it in `update_state`.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...backends.transfer import to_device
from ...checks import is_integer
from .spec_layout import SpecDecodeLayout

if TYPE_CHECKING:
    from ..params import SamplingParams

__all__ = ["AddedRequest", "BatchUpdate", "LogitsProcessor", "MoveDirectionality", "MovedRequest", "RemovedRequest"]


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # the request at index a moves to index b; a is left empty
    SWAP = enum.auto()  # the requests at a and b trade places


RemovedRequest = int  # the index a finished or preempted request left
AddedRequest = tuple[int, "SamplingParams", "list[int] | None", "list[int]"]  # (index, params, prompt ids, output ids)
MovedRequest = tuple[int, int, MoveDirectionality]  # (a, b, directionality)


@dataclass(frozen=True)
class BatchUpdate:
    """What changed in the persistent batch since the last step. Apply `added`, then `removed`,
    then `moved` in list order (a request added this step may already be moved by a condense)."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]

    def __post_init__(self) -> None:
        # Checked here, where the row is known, not as an IndexError (a device assert on GPU) later
        # in some processor. A move's source may lie past the new size (condensing); nothing else.
        if not is_integer(self.batch_size) or self.batch_size < 0:
            raise ValueError(f"BatchUpdate batch_size must be an integer >= 0, got {self.batch_size!r}")
        for added in self.added:
            _check_row(added[0], "a request is added at row", self.batch_size)
        for a, b, directionality in self.moved:
            _check_row(b, "a request is moved to row", self.batch_size)
            if directionality is MoveDirectionality.SWAP:
                _check_row(a, "a request is swapped from row", self.batch_size)


def _check_row(index: int, what: str, batch_size: int) -> None:
    if not is_integer(index) or not 0 <= index < batch_size:
        raise ValueError(f"{what} {index!r}, outside the batch of {batch_size} rows")


class LogitsProcessor(ABC):
    """A batch-level logits transformation with per-row state (vLLM v1's interface).

    Subclasses take what they need (vocabulary size, device, special tokens) in `__init__`.
    """

    def validate_params(self, params: SamplingParams) -> None:
        """Raise ValueError when `params` asks for something this processor cannot do."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when `apply` never changes a row's argmax: the sampler then skips this processor
        for all-greedy batches."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Follow the persistent batch (None: no request was added, removed or moved) and read the
        tokens the running requests generated since the last call."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Transform float32 logits (batch_size, V), in place or not; return the result."""

    def apply_with_spec_decode(
        self,
        logits: torch.Tensor,
        num_draft_tokens: Sequence[int],
        draft_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Transform target logits under speculative decoding: request r owns num_draft_tokens[r] + 1
        consecutive rows (one per draft position, then the bonus position), and row j of request r
        must be processed with the state the request would have after its first j drafts
        (draft_token_ids[r][:j]).

        This default suits processors whose effect does not depend on the tokens generated so far:
        it processes every position of a request as that request's current row. Processors with
        per-token state override it.
        """
        layout = SpecDecodeLayout(num_draft_tokens, logits.shape[0], draft_token_ids)
        for position in range(layout.max_positions):
            rows, present = layout.rows_at_position(position)
            processed = self.apply(logits.index_select(0, to_device(rows, logits.device)))
            keep = torch.as_tensor(present).nonzero().flatten()  # a host tensor: no device sync
            targets = to_device(rows[keep], logits.device)
            logits.index_copy_(0, targets, processed.index_select(0, to_device(keep, logits.device)))
        return logits
