"""Per-sequence constraint state for decode loops: one interface over a TreeDFA (states kept here,
forced tokens available) and over any grammar the StructuredOutputManager compiles."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .bitmask import allocate_token_bitmask
from .forced import ForcedTokens
from .manager import StructuredOutputManager
from .tree import TreeDFA
from .tree.cursor import TreeCursor


class TreeConstraint(TreeCursor):
    """A sequence's cursor in a TreeDFA in a decode loop, with the interface GrammarConstraint
    shares (valid_prefix, commit, forced, forced_tokens, end_of, is_terminated). `commit` takes the tokens
    the loop decided (sampled under the tree's mask): every token moves. `fork()` copies it
    (beams, n > 1)."""

    __slots__ = ()


class GrammarConstraint:
    """A request registered with a StructuredOutputManager (xgrammar kinds or tree kinds)."""

    def __init__(self, manager: StructuredOutputManager, request_id: str) -> None:
        self.manager = manager
        self.request_id = request_id

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        return len(self.manager.validate_tokens(self.request_id, list(drafts)))

    def commit(self, tokens: Sequence[int]) -> None:
        """Take the tokens the loop decided; RuntimeError when the grammar refuses them (they
        were sampled under its mask, so that is a bug, not a draft to reject)."""
        if tokens and not self.manager.accept_tokens(self.request_id, list(tokens)):
            raise RuntimeError(f"request {self.request_id!r}: the grammar rejected sampled tokens {list(tokens)}")

    def forced(self, max_len: int) -> ForcedTokens:
        """What the grammar fixes next (StructuredOutputManager.forced): the first
        `num_mask_forced` tokens are forced by the mask, the rest are string-forced drafts that
        must be verified under the mask."""
        return self.manager.forced(self.request_id, max_len)

    def forced_tokens(self, max_len: int) -> list[int]:
        """forced(max_len).tokens: proposals, not all of them safe to commit unverified."""
        return self.forced(max_len).tokens

    def end_of(self, tokens: Sequence[int]) -> int | None:
        """As TreeConstraint.end_of. A grammar accepts nothing after its stop token, so it can only
        end at the last token of the prefix it validates; that is checked by accepting the prefix
        and rolling it back."""
        manager, request_id = self.manager, self.request_id
        prefix = manager.validate_tokens(request_id, list(tokens))
        if prefix and manager.accept_tokens(request_id, prefix):
            ended = manager.is_terminated(request_id)
            manager.rollback(request_id, len(prefix))
        else:
            ended = manager.is_terminated(request_id)
        return len(prefix) if ended else None

    def is_terminated(self) -> bool:
        return self.manager.is_terminated(self.request_id)


def fill_constraint_rows(
    constraints: Sequence[TreeConstraint | GrammarConstraint | None],
    drafts: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, list[int]]:
    """int32 bitmask with 1 + len(drafts[i]) rows per sequence in vLLM's layout (draft rows, then the
    bonus row): tree rows in one batched fill, grammar rows in one manager call, -1 elsewhere; and
    the indices of the constrained rows (so that only those need masking)."""
    total = sum(1 + len(d) for d in drafts)
    bitmask = allocate_token_bitmask(total, vocab_size, device=device)
    offsets, row = [], 0
    for d in drafts:
        offsets.append(row)
        row += 1 + len(d)
    by_tree: dict[int, tuple[TreeDFA, list[int], list[int]]] = {}
    grammar_ids: list[tuple[int, GrammarConstraint]] = []
    constrained: list[int] = []
    for i, c in enumerate(constraints):
        if c is not None:
            constrained.extend(range(offsets[i], offsets[i] + 1 + len(drafts[i])))
        if isinstance(c, TreeConstraint):
            states = c.walk_states(drafts[i])
            _, rows, all_states = by_tree.setdefault(id(c.tree), (c.tree, [], []))
            rows.extend(range(offsets[i], offsets[i] + len(states)))
            all_states.extend(states)
        elif isinstance(c, GrammarConstraint):
            grammar_ids.append((i, c))
    for tree, rows, states in by_tree.values():
        part = allocate_token_bitmask(len(rows), vocab_size, device=tree.device)
        tree.fill_bitmask(torch.tensor(states, dtype=torch.int32, device=tree.device), part)
        bitmask[torch.tensor(rows, device=device)] = part.to(device)
    if grammar_ids:
        manager = grammar_ids[0][1].manager
        ids = [c.request_id for _, c in grammar_ids]
        spec = {c.request_id: list(drafts[i]) for i, c in grammar_ids}
        rows_host = manager.grammar_bitmask(ids, spec)
        at = 0
        for i, c in grammar_ids:
            n = 1 + len(drafts[i])
            bitmask[offsets[i] : offsets[i] + n, : rows_host.shape[1]] = rows_host[at : at + n].to(device)
            at += n
    return bitmask, constrained
