"""TreeDFA as a grammar backend: `prefix_dict` (RTP-LLM tree decode) and `token_trie` constraints.

A TreeDFA state is an int node id and the tree is immutable, so a grammar is a TreeCursor (its list
of visited states: validate follows tokens without taking them, rollback truncates the list). Trees are built
on the host because the manager's bitmask lives there; a whole batch of rows is one
`TreeDFA.fill_bitmask` call per tree.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ...checks import as_token_id
from ..grammar import BaseGrammarBackend, Grammar
from ..params import load_token_trie_payload
from ..registry import register_grammar_backend
from .cursor import TreeCursor

logger = logging.getLogger(__name__)

__all__ = ["TreeBackend", "TreeGrammar"]


class TreeGrammar(TreeCursor):
    """One request's cursor in a TreeDFA as a Grammar (grammar.py): a token is accepted when it
    is one of the current state's allowed tokens (RTP-LLM's candidates, end-token fallback
    included) and the cursor has not finished; the end token finishes it (TreeCursor.accept)."""

    __slots__ = ()

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        return self.accept(tokens)

    def validate_tokens(self, tokens: Sequence[int]) -> list[int]:
        return self.accepted_prefix(tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        _fill_rows(self.tree, [self.state], bitmask, [row])

    def fresh(self) -> TreeGrammar:
        return TreeGrammar(self.tree)

    @property
    def num_accepted_tokens(self) -> int:
        return self.num_tokens


def _fill_rows(tree: Any, states: list[int], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    # TreeDFA.fill_bitmask writes one row per state into the bitmask it is given; fill a scratch
    # block and scatter it so the manager's rows need not be contiguous. The scatter goes through
    # numpy (the bitmask is a host tensor): torch's index_put hands a few rows to its intra-op
    # threads, which costs milliseconds on a busy host.
    scratch = torch.from_numpy(np.empty((len(states), bitmask.shape[1]), dtype=np.int32))
    tree.fill_bitmask(torch.tensor(states, dtype=torch.int64), scratch)
    bitmask.numpy()[np.asarray(rows, dtype=np.int64)] = scratch.numpy()


class TreeBackend(BaseGrammarBackend):
    """Compiles prefix dicts and token tries into host-resident TreeDFAs."""

    name = "tree"
    kinds = frozenset({"prefix_dict", "token_trie"})

    def __init__(self, tokenizer_info: Any = None, *, vocab_size: int, end_token_id: int | None = None) -> None:
        super().__init__(vocab_size=vocab_size)
        if end_token_id is None and tokenizer_info is not None and list(tokenizer_info.stop_token_ids):
            end_token_id = int(tokenizer_info.stop_token_ids[0])
        self.default_end_token_id = end_token_id

    def compile(self, kind: str, spec: Any, *, disable_any_whitespace: bool = False) -> TreeGrammar:
        if kind not in self.kinds:
            raise ValueError(f"the tree backend cannot compile {kind!r} constraints")
        try:
            from .dfa import TreeDFA
        except ImportError as exc:
            raise ValueError(f"{kind} constraints need logitgate's TreeDFA, which is not available: {exc}") from exc
        if kind == "prefix_dict":
            config = dict(spec) if isinstance(spec, Mapping) else spec
            tree = TreeDFA.from_prefix_dict(config, vocab_size=self.vocab_size, device="cpu")
        else:
            payload = load_token_trie_payload(spec)  # a dict, a JSON string or a path
            end_token_id = payload.pop("end_token_id", self.default_end_token_id)
            if end_token_id is None:
                raise ValueError(
                    "a token_trie constraint needs an end token: put end_token_id in the payload or give "
                    "the manager a tokenizer_info with stop tokens"
                )
            end_token_id = as_token_id(end_token_id, self.vocab_size, " (the token_trie's end_token_id)")
            tree = TreeDFA.from_token_trie(payload, end_token_id=end_token_id, vocab_size=self.vocab_size, device="cpu")
        return TreeGrammar(tree)

    def fill_bitmasks(self, grammars: Sequence[Grammar], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        by_tree: dict[int, tuple[Any, list[int], list[int]]] = {}
        for grammar, row in zip(grammars, rows):
            tree = grammar.tree  # type: ignore[attr-defined]
            _, states, tree_rows = by_tree.setdefault(id(tree), (tree, [], []))
            states.append(grammar.state)  # type: ignore[attr-defined]
            tree_rows.append(row)
        for tree, states, tree_rows in by_tree.values():
            _fill_rows(tree, states, bitmask, tree_rows)


register_grammar_backend("tree", TreeBackend)
