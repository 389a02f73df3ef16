"""Tree (RTP-LLM's tree decode as a logits processor): each request that asks for it in
`SamplingParams.extra_args` is constrained to the paths of a TreeDFA. The extra_args keys are the
request format of structured/tree/request.py (`TreeRequest`, `tree_request`, re-exported here); a
token trie's end token defaults to the processor's `eos_token_id`; a request with no tree is left
alone.

Trees come from the TreeDFA loaders and their process-wide compile cache, so requests that bring
the same tree share one compiled copy. A row's state follows the request's output-token list (the
engine's own list, held by reference): new tokens are read when the logits are processed, not in
`update_state`, because under vLLM's async scheduling the last entries are -1 placeholders until
just before sampling.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from ...backends.formats import num_bitmask_words
from ...backends.transfer import to_device
from ...structured.bitmask import apply_token_bitmask_inplace
from ...structured.tree import TreeDFA
from ...structured.tree.candidates import host_widths, keep_only_allowed
from ...structured.tree.cursor import TreeCursor
from ...structured.tree.loaders import check_token_id, check_vocab_size
from ...structured.tree.prompt import warn_prompt_start
from ...structured.tree.request import TREE_ARG_KEYS, TreeRequest, tree_request
from .interface import BatchUpdate, LogitsProcessor
from .spec_layout import SpecDecodeLayout
from .state import process_dict_updates, validate_added

__all__ = ["TREE_ARG_KEYS", "Tree", "TreeRequest", "tree_request"]

logger = logging.getLogger(__name__)


class _TreeRow:
    """One request's cursor and the output-token list it follows (TreeCursor.follow)."""

    __slots__ = ("output_ids", "cursor")

    def __init__(self, tree: TreeDFA, output_ids: list[int]) -> None:
        self.cursor = TreeCursor(tree)
        self.output_ids = output_ids

    def catch_up(self) -> TreeCursor:
        self.cursor.follow(self.output_ids)
        return self.cursor


class Tree(LogitsProcessor):
    """Only tokens on the request's tree are allowed (RTP-LLM semantics: the end token is the
    fallback of a missing key, an unknown token leads to the error state, the end token finishes).

    vocab_size: the model's vocabulary (token ids are checked against it); device: where logits
    and compiled trees live; eos_token_id: the default end token of a token trie; pin_memory:
    stage the per-step state uploads in pinned host memory (CUDA/NPU).
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str = "cpu",
        *,
        eos_token_id: int | None = None,
        pin_memory: bool = False,
    ) -> None:
        check_vocab_size(vocab_size)
        if vocab_size is None:
            raise ValueError("vocab_size is required: the model's vocabulary size")
        if eos_token_id is not None:
            check_token_id(eos_token_id, "eos_token_id", vocab_size)
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self.eos_token_id = eos_token_id
        self.pin_memory = pin_memory
        self._rows: dict[int, _TreeRow] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def tree_for(self, params: Any) -> TreeDFA | None:
        """The compiled tree `params` asks for (None: no tree); ValueError names the problem."""
        request = tree_request(params)
        if request is None:
            return None
        return request.compile(self.vocab_size, self.device, self.eos_token_id)

    def validate_params(self, params: Any) -> None:
        self.tree_for(params)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return  # tokens are read in apply (see the module docstring)
        trees: dict[int, TreeDFA | None] = {}
        # Compile every added request first: a bad one raises (naming its row) before any state changes.
        validate_added(batch_update, lambda params: trees.__setitem__(id(params), self.tree_for(params)))
        for index, params, prompt_ids, _ in batch_update.added:  # once per request, never per step
            if trees[id(params)] is not None:
                warn_prompt_start(trees[id(params)], prompt_ids, f"tree_decode request added at row {index}")

        def new_row(params: Any, _prompt: list[int] | None, output_ids: list[int]) -> _TreeRow | None:
            tree = trees[id(params)]
            return None if tree is None else _TreeRow(tree, output_ids)

        process_dict_updates(self._rows, batch_update, new_row)

    def state(self, index: int) -> int | None:
        """The tree state of the request at row `index` after its output so far (None: no tree)."""
        row = self._rows.get(index)
        if row is None:
            return None
        row.catch_up()
        return row.cursor.state

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        entries = []
        for index, row in self._rows.items():
            row.catch_up()
            entries.append((index, row.cursor.tree, row.cursor.state))
        return self.mask_rows(logits, entries)

    def apply_with_spec_decode(self, logits, num_draft_tokens, draft_token_ids=None) -> torch.Tensor:
        layout = SpecDecodeLayout(num_draft_tokens, logits.shape[0], draft_token_ids)
        entries = []
        for index, row in self._rows.items():
            row.catch_up()
            drafts = [int(t) for t in layout.drafts(index, "Tree")]
            # A placeholder draft (an id outside the vocabulary) is always rejected, so the rows
            # after it are never sampled; they get the error state, as TreeDFA.advance would give.
            valid = next((i for i, t in enumerate(drafts) if not 0 <= t < self.vocab_size), len(drafts))
            tree = row.cursor.tree
            states = row.cursor.walk_states(drafts[:valid]) + [tree.error_state] * (len(drafts) - valid)
            entries.extend((logit_row, tree, s) for logit_row, s in zip(layout.rows_of(index), states))
        return self.mask_rows(logits, entries)

    def _upload(self, values: list[int], device: torch.device) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.int64)
        if self.pin_memory and device.type != "cpu":
            host = host.pin_memory()
        return to_device(host, device)

    def mask_rows(self, logits: torch.Tensor, entries: list[tuple[int, TreeDFA, int]]) -> torch.Tensor:
        """Mask logits row r to the allowed set of its tree state. Trees on the logits' device: per
        tree, fill its rows with -inf and put the allowed logits back (no bitmask; the widest row
        of the step bounds the work, states are on the host). Elsewhere: one batched
        `fill_bitmask` per tree and one bitmask apply. Rows without an entry keep their logits."""
        if not entries:
            return logits
        by_tree: dict[int, tuple[TreeDFA, list[tuple[int, int]]]] = {}
        for logit_row, tree, state in entries:
            by_tree.setdefault(id(tree), (tree, []))[1].append((logit_row, state))
        if all(tree.device == logits.device for tree, _ in by_tree.values()):
            for tree, pairs in by_tree.values():
                states = [state for _, state in pairs]
                widest = int(host_widths(tree, np.asarray(states, dtype=np.int64)).max())
                keep_only_allowed(
                    tree, logits, self._upload(states, tree.device), self._upload([row for row, _ in pairs], logits.device),
                    max_width=widest,
                )
            return logits
        # Rows the apply skips (no entry) are never read, so the bitmask needs no initialisation.
        words = num_bitmask_words(logits.shape[-1])
        bitmask = torch.empty((logits.shape[0], words), dtype=torch.int32, device=logits.device)
        masked_rows: list[int] = []
        for tree, pairs in by_tree.values():
            pairs.sort()
            rows = [row for row, _ in pairs]
            states = self._upload([state for _, state in pairs], tree.device)
            if rows[-1] - rows[0] + 1 == len(rows) and tree.device == bitmask.device:
                tree.fill_bitmask(states, bitmask[rows[0] : rows[-1] + 1])  # consecutive rows: fill in place
            else:
                part = torch.empty((len(rows), words), dtype=torch.int32, device=tree.device)
                tree.fill_bitmask(states, part)
                bitmask.index_copy_(0, self._upload(rows, bitmask.device), to_device(part, bitmask.device))
            masked_rows.extend(rows)
        apply_token_bitmask_inplace(logits, bitmask, indices=masked_rows)
        return logits
