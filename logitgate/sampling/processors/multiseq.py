"""MultiSeq (RTP-LLM's MultiSeqLogitsProcessor): once a sequence has finished — it emitted one of
its stop tokens — it may only emit EOS. Batched generation (beams, num_return_sequences, padded
batches) keeps finished rows in the batch; this pads them with EOS instead of letting them ramble."""
from __future__ import annotations

import torch

from ...checks import is_integer
from ..params import SamplingParams
from .interface import BatchUpdate
from .spec_layout import SpecDecodeLayout
from .state import TokenMaskProcessor, process_dict_updates, validate_added

__all__ = ["MultiSeq"]


class _SeqState:
    __slots__ = ("consumed", "finished", "output_ids", "stop_ids")

    def __init__(self, output_ids: list[int], stop_ids: frozenset[int]) -> None:
        self.output_ids = output_ids
        self.stop_ids = stop_ids
        self.consumed = 0
        self.finished = False

    def catch_up(self) -> bool:
        """Read tokens appended since the last call; True when the sequence finished just now."""
        if self.finished:
            self.consumed = len(self.output_ids)
            return False
        new = self.output_ids[self.consumed :]
        self.consumed += len(new)
        self.finished = any(t in self.stop_ids for t in new)
        return self.finished


class MultiSeq(TokenMaskProcessor):
    """A row whose output contains one of its stop tokens (stop_token_ids, plus eos_token_id
    unless ignore_eos) allows only `eos_token_id` from then on."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", *, eos_token_id: int) -> None:
        if not is_integer(eos_token_id) or not 0 <= eos_token_id < vocab_size:
            raise ValueError(f"eos_token_id {eos_token_id!r} is outside the vocabulary [0, {vocab_size})")
        super().__init__(vocab_size, device)
        self.eos_token_id = eos_token_id

    def _new_state(self, params: SamplingParams, _prompt, output_ids: list[int]) -> _SeqState:
        return _SeqState(output_ids, frozenset(params.all_stop_token_ids(self.eos_token_id)))

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        validate_added(batch_update, self.validate_params)
        changed = process_dict_updates(self._states, batch_update, self._new_state)
        newly_finished = [state.catch_up() for state in self._states.values()]
        if changed or any(newly_finished):
            finished = [(index, self.eos_token_id) for index, state in self._states.items() if state.finished]
            self._mask.set((), finished)

    def apply_with_spec_decode(self, logits, num_draft_tokens, draft_token_ids=None) -> torch.Tensor:
        layout = SpecDecodeLayout(num_draft_tokens, logits.shape[0], draft_token_ids)
        forced = []
        for index, state in self._states.items():
            finished_at = 0 if state.finished else None
            if finished_at is None:
                for j, token in enumerate(layout.drafts(index, "MultiSeq")):
                    if token in state.stop_ids:
                        finished_at = j + 1  # the positions after a drafted stop token
                        break
            if finished_at is not None:
                forced.extend((row, self.eos_token_id) for row in layout.rows_of(index)[finished_at:])
        return self._apply_once(logits, (), forced)
