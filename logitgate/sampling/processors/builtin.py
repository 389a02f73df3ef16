"""vLLM's built-in logits processors: MinP, LogitBias, MinTokens — also under speculative decoding
(vLLM skips min_p and logit_bias there; logitgate applies them at every draft position)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ...backends.transfer import to_device
from .. import ops
from ..params import SamplingParams
from .interface import BatchUpdate, LogitsProcessor
from .spec_layout import SpecDecodeLayout
from .state import TokenMaskProcessor, process_dict_updates, validate_added

__all__ = ["LogitBias", "MinP", "MinTokens", "builtin_logits_processors"]


class MinP(LogitsProcessor):
    """Remove tokens whose probability is below min_p times the row's top probability. Argmax-
    invariant (the top token always stays), so all-greedy batches skip it."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._min_p: dict[int, float] = {}
        self._batch_size = 0
        self._values: torch.Tensor | None = None  # float32 (batch_size,), 0 where off

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        changed = process_dict_updates(self._min_p, batch_update, lambda params, _p, _o: params.min_p or None)
        size = self._batch_size if batch_update is None else batch_update.batch_size
        if changed or size != self._batch_size:
            self._batch_size = size
            dense = [0.0] * size
            for index, value in self._min_p.items():
                dense[index] = value
            self._values = to_device(torch.tensor(dense, dtype=torch.float32), self.device) if self._min_p else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self._values is None:
            return logits
        return ops.apply_min_p(logits, self._values)

    def apply_with_spec_decode(self, logits, num_draft_tokens, draft_token_ids=None) -> torch.Tensor:
        layout = SpecDecodeLayout(num_draft_tokens, logits.shape[0], draft_token_ids)
        if self._values is None:
            return logits
        per_row = self._values.index_select(0, to_device(layout.request_of_row(), self.device))
        return ops.apply_min_p(logits, per_row)


class LogitBias(LogitsProcessor):
    """Add each request's logit_bias values to its logits."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._bias: dict[int, dict[int, float]] = {}
        self._slice: tuple[torch.Tensor, torch.Tensor] | None = None
        self._values: torch.Tensor | None = None

    def is_argmax_invariant(self) -> bool:
        return False

    def validate_params(self, params: SamplingParams) -> None:
        params.verify(self.vocab_size)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        validate_added(batch_update, self.validate_params)
        if process_dict_updates(self._bias, batch_update, lambda params, _p, _o: params.logit_bias or None):
            self._slice, self._values = self._upload({index: [index] for index in self._bias})

    def _upload(self, rows_of: dict[int, Sequence[int]]):
        """(rows, tokens) index tensors and bias values: each request's biases at each of its rows."""
        rows, tokens, values = [], [], []
        for index, logit_rows in rows_of.items():
            for token, bias in self._bias[index].items():
                for row in logit_rows:
                    rows.append(row)
                    tokens.append(token)
                    values.append(bias)
        if not rows:
            return None, None
        index_pair = to_device(torch.tensor([rows, tokens], dtype=torch.int64), self.device)
        return (index_pair[0], index_pair[1]), to_device(torch.tensor(values, dtype=torch.float32), self.device)

    @staticmethod
    def _add(logits: torch.Tensor, index_pair, values) -> torch.Tensor:
        if index_pair is not None:
            logits.index_put_(index_pair, values.to(logits.dtype), accumulate=True)
        return logits

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return self._add(logits, self._slice, self._values)

    def apply_with_spec_decode(self, logits, num_draft_tokens, draft_token_ids=None) -> torch.Tensor:
        layout = SpecDecodeLayout(num_draft_tokens, logits.shape[0], draft_token_ids)
        if not self._bias:
            return logits
        return self._add(logits, *self._upload({index: layout.rows_of(index) for index in self._bias}))


class _MinTokensState:
    __slots__ = ("min_tokens", "output_ids", "stop_ids")

    def __init__(self, min_tokens: int, output_ids: list[int], stop_ids: list[int]) -> None:
        self.min_tokens = min_tokens
        self.output_ids = output_ids
        self.stop_ids = stop_ids


class MinTokens(TokenMaskProcessor):
    """Mask a request's stop tokens (stop_token_ids and, unless ignore_eos, the EOS) until it has
    generated min_tokens tokens."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", *, eos_token_id: int | None = None) -> None:
        super().__init__(vocab_size, device)
        self.eos_token_id = eos_token_id

    def _new_state(self, params: SamplingParams, _prompt, output_ids: list[int]) -> _MinTokensState | None:
        stops = sorted(params.all_stop_token_ids(self.eos_token_id))
        if not params.min_tokens or not stops:
            return None
        return _MinTokensState(params.min_tokens, output_ids, stops)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        validate_added(batch_update, self.validate_params)
        changed = process_dict_updates(self._states, batch_update, self._new_state)
        done = [index for index, state in self._states.items() if len(state.output_ids) >= state.min_tokens]
        for index in done:
            del self._states[index]
        if changed or done:
            self._mask.set(((index, t) for index, state in self._states.items() for t in state.stop_ids), ())

    def apply_with_spec_decode(self, logits, num_draft_tokens, draft_token_ids=None) -> torch.Tensor:
        layout = SpecDecodeLayout(num_draft_tokens, logits.shape[0], draft_token_ids)
        if not self._states:
            return logits
        banned = []
        for index, state in self._states.items():
            # Position j follows j accepted drafts: the request then has len(output) + j tokens.
            still = max(0, min(state.min_tokens - len(state.output_ids), layout.num_draft_tokens[index] + 1))
            banned.extend((layout.row(index, j), t) for j in range(still) for t in state.stop_ids)
        return self._apply_once(logits, banned, ())


def builtin_logits_processors(
    vocab_size: int, device: torch.device | str = "cpu", *, eos_token_id: int | None = None
) -> list[LogitsProcessor]:
    """vLLM's built-ins for a model: MinP, LogitBias, MinTokens."""
    return [MinP(device), LogitBias(vocab_size, device), MinTokens(vocab_size, device, eos_token_id=eos_token_id)]
