"""Where each request's rows sit in target logits under speculative decoding. Shared by the
LogitsProcessor interface (its default apply_with_spec_decode) and the processors that override it."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["SpecDecodeLayout"]


class SpecDecodeLayout:
    """Rows of target logits under speculative decoding: request r owns num_draft_tokens[r] + 1
    consecutive rows (its draft positions, then the bonus position). Host-side bookkeeping only."""

    def __init__(
        self,
        num_draft_tokens: Sequence[int],
        num_rows: int,
        draft_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        counts = [int(n) for n in num_draft_tokens]
        for r, n in enumerate(counts):
            if n < 0:
                raise ValueError(f"num_draft_tokens[{r}] is {n}; draft counts must be >= 0")
        if sum(counts) + len(counts) != num_rows:
            raise ValueError(
                f"logits have {num_rows} rows but num_draft_tokens {counts} needs sum(n + 1) = {sum(counts) + len(counts)}"
            )
        if draft_token_ids is not None:
            if len(draft_token_ids) != len(counts):
                raise ValueError(f"draft_token_ids has {len(draft_token_ids)} requests, num_draft_tokens {len(counts)}")
            for r, (drafts, n) in enumerate(zip(draft_token_ids, counts)):
                if len(drafts) != n:
                    raise ValueError(f"request {r} has {len(drafts)} draft token ids but num_draft_tokens[{r}] = {n}")
        self.num_draft_tokens = counts
        self.draft_token_ids = draft_token_ids
        self.offsets = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64) + 1)])[:-1].astype(np.int64)
        self.max_positions = max(counts) + 1 if counts else 0

    @property
    def batch_size(self) -> int:
        return len(self.num_draft_tokens)

    def row(self, request: int, position: int) -> int:
        return int(self.offsets[request]) + position

    def rows_of(self, request: int) -> range:
        """The rows of one request, draft positions then the bonus position."""
        start = int(self.offsets[request])
        return range(start, start + self.num_draft_tokens[request] + 1)

    def rows_at_position(self, position: int) -> tuple[torch.Tensor, np.ndarray]:
        """Per request, its row at `position` (its last row where it has fewer), and whether it has
        that position. Host tensors."""
        counts = np.asarray(self.num_draft_tokens, dtype=np.int64)
        rows = self.offsets + np.minimum(position, counts)
        return torch.from_numpy(rows), position <= counts

    def request_of_row(self) -> torch.Tensor:
        """int64 host tensor (num_rows,): the request each row belongs to."""
        counts = np.asarray(self.num_draft_tokens, dtype=np.int64) + 1
        return torch.from_numpy(np.repeat(np.arange(len(counts), dtype=np.int64), counts))

    def drafts(self, request: int, processor: str) -> Sequence[int]:
        if self.draft_token_ids is None:
            if self.num_draft_tokens[request] == 0:
                return ()
            raise ValueError(f"{processor} needs draft_token_ids under speculative decoding (its state follows the drafts)")
        return self.draft_token_ids[request]
