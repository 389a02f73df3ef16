"""Hugging Face `generate()` integration.

`TreeLogitsProcessor(tree)` constrains every row (greedy, sampling, beams, num_return_sequences)
to paths of a TreeDFA. Row states are derived from `input_ids` at every step by replaying the
generated tokens through the compiled tree on the device — no state is carried between calls, so
beam search reordering and forking rows cannot corrupt it, and nothing syncs with the host.
"""
from __future__ import annotations

import torch

from ..structured.bitmask import allocate_token_bitmask, apply_token_bitmask_inplace
from ..structured.tree import TreeDFA

try:  # transformers is optional: the processor is a plain callable either way
    from transformers import LogitsProcessor as _HFLogitsProcessor
except ImportError:  # pragma: no cover - exercised only without the hf extra
    _HFLogitsProcessor = object


class TreeLogitsProcessor(_HFLogitsProcessor):
    """Only tokens on the tree are allowed; the end token is the fallback (RTP-LLM semantics).

    The prompt of every row must end where the tree starts (for a prefix dict: with
    `start_token_id`). `prompt_length` defaults to the input length at the first call of a
    generation; a call with fewer or equally many columns starts a new generation.
    """

    def __init__(self, tree: TreeDFA, prompt_length: int | None = None) -> None:
        self.tree = tree
        self._fixed_prompt_length = prompt_length
        self._prompt_length: int | None = prompt_length
        self._last_length = -1
        self._bitmask: torch.Tensor | None = None

    def states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Tree state of every row after its generated tokens (batched, on device)."""
        length = input_ids.shape[1]
        if self._fixed_prompt_length is None and (self._prompt_length is None or length <= self._last_length):
            self._prompt_length = length  # first call of a new generation
        self._last_length = length
        tree_ids = input_ids.to(self.tree.device)
        states = torch.full((input_ids.shape[0],), self.tree.root, dtype=torch.int32, device=self.tree.device)
        for column in range(self._prompt_length, length):
            states = self.tree.advance(states, tree_ids[:, column])
        return states

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        states = self.states(input_ids)
        rows, vocab = scores.shape
        if self._bitmask is None or self._bitmask.shape[0] != rows or self._bitmask.device != scores.device:
            self._bitmask = allocate_token_bitmask(rows, vocab, device=scores.device)
        self.tree.fill_bitmask(states, self._bitmask)
        scores = scores.clone()  # transformers expects a new tensor; inputs may be reused by callers
        apply_token_bitmask_inplace(scores, self._bitmask)
        return scores
