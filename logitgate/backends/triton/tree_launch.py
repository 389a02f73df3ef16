"""Tree-candidate kernels through Triton, for the backends that run Triton (CUDA, Ascend).

A mixin so CUDA and NPU share the dispatch and differ only in launch sizing (`_tree_launch`);
where Triton is unavailable the Backend defaults (the torch reference) run instead.
"""
from __future__ import annotations

from typing import Any

import torch

# keep moves values as bits through an integer view of these dtypes (others use the reference).
_BIT_VIEW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class TritonTreeMixin:
    def _tree_uses_triton(self) -> bool:
        raise NotImplementedError

    def _tree_launch(self, bytes_per_token: int) -> dict[str, Any]:
        """block (lanes per tile) and max_programs (grid-stride launch) for a tree kernel."""
        raise NotImplementedError

    def _tree_kernel_names(self) -> dict[str, str]:
        if not self._tree_uses_triton():
            return {"tree_candidates": "torch reference (index ops, no sync)", "fill_tree_bitmask": "torch reference (scatter_add, no sync)"}
        return {
            "tree_candidates": "triton (gather: one pass over the candidates; keep: save them, fill the rows "
            "with -inf, put them back)",
            "fill_tree_bitmask": "triton (dense rows copied, sparse tokens added with atomics)",
        }

    def _check_candidates(self, logits, candidates) -> None:
        self.check_on_device(
            logits=logits, rows=candidates.rows, starts=candidates.starts, widths=candidates.widths, allow_tok=candidates.allow_tok
        )

    def gather_candidate_logits(self, logits, candidates):
        if not self._tree_uses_triton():
            return super().gather_candidate_logits(logits, candidates)
        self._check_candidates(logits, candidates)
        from .tree import CANDIDATE_BYTES_PER_TOKEN, gather_candidate_logits_triton

        return gather_candidate_logits_triton(logits, *candidates, **self._tree_launch(CANDIDATE_BYTES_PER_TOKEN))

    def keep_candidate_logits(self, logits, candidates):
        if not self._tree_uses_triton() or logits.dtype not in _BIT_VIEW_DTYPES:
            super().keep_candidate_logits(logits, candidates)
            return
        self._check_candidates(logits, candidates)
        from .tree import CANDIDATE_BYTES_PER_TOKEN, FILL_ROW_BYTES_PER_TOKEN, keep_candidate_logits_triton

        launch = self._tree_launch(CANDIDATE_BYTES_PER_TOKEN)
        fill_block = self._tree_launch(FILL_ROW_BYTES_PER_TOKEN)["block"]
        keep_candidate_logits_triton(logits, *candidates, fill_block=fill_block, **launch)

    def fill_tree_bitmask(self, bitmask, states, allow_start, allow_tok, fill_width, max_width, dense_rows, dense_slot):
        if not self._tree_uses_triton():
            super().fill_tree_bitmask(bitmask, states, allow_start, allow_tok, fill_width, max_width, dense_rows, dense_slot)
            return
        self.check_on_device(
            bitmask=bitmask, states=states, allow_start=allow_start, allow_tok=allow_tok, fill_width=fill_width,
            dense_rows=dense_rows, dense_slot=dense_slot,
        )
        from .tree import BITMASK_BYTES_PER_WORD, fill_tree_bitmask_triton

        fill_tree_bitmask_triton(
            bitmask, states, allow_start, allow_tok, fill_width, max_width, dense_rows, dense_slot,
            **self._tree_launch(BITMASK_BYTES_PER_WORD),
        )
