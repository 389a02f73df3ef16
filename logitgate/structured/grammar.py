"""The Grammar and GrammarBackend protocols every constraint engine implements.

A `GrammarBackend` compiles a constraint (kind + spec) into a `Grammar`: one request's matcher state.
The manager only talks to these protocols, so an engine (xgrammar, TreeDFA, llguidance, ...) is one
module with a backend class registered in `structured.registry`.

Bitmasks handed to a grammar are host (CPU) int32 tensors in xgrammar's format. A grammar may also
offer `fork()` (an independent copy at the same state; the built-in engines do); callers that fork
rows (beams, n > 1) fall back to `fresh()` plus a replay of the tokens without it.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from .bitmask import allocate_token_bitmask

logger = logging.getLogger(__name__)

__all__ = ["BaseGrammarBackend", "Grammar", "GrammarBackend", "TokenHistory"]


@runtime_checkable
class Grammar(Protocol):
    """One request's constraint state.

    `accept_tokens` is all or nothing: when a token is rejected the grammar is left as it was.
    """

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advance through `tokens`; False (and no state change) if any is rejected."""

    def validate_tokens(self, tokens: Sequence[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar would accept; the state does not change."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (ValueError if fewer were accepted)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (host int32)."""

    def is_terminated(self) -> bool:
        """True once the grammar accepted its stop/end token; it accepts nothing after that."""

    def reset(self) -> None:
        """Back to the start state."""

    def fresh(self) -> Grammar:
        """A new grammar over the same compiled constraint, at its start state (compile-cache reuse)."""


@runtime_checkable
class GrammarBackend(Protocol):
    """A constraint engine: compiles specs into grammars and fills their bitmask rows."""

    name: str
    kinds: frozenset[str]  # the StructuredOutputsParams kinds it compiles

    def compile(self, kind: str, spec: Any, *, disable_any_whitespace: bool = False) -> Grammar:
        """Compile a constraint; raises (any exception) with the reason when it cannot."""

    def allocate_token_bitmask(self, num_rows: int) -> torch.Tensor:
        """A host int32 bitmask (num_rows, ceil(V/32)) in the layout `fill_bitmask` writes."""

    def fill_bitmasks(self, grammars: Sequence[Grammar], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """`grammars[i].fill_bitmask(bitmask, rows[i])` for all i; engines override to batch it."""

    def accept_batch(self, grammars: Sequence[Grammar], tokens: Sequence[int]) -> list[bool]:
        """`[g.accept_tokens([t]) for g, t in zip(grammars, tokens)]`; engines override to batch it."""

    def rollback_batch(self, grammars: Sequence[Grammar], num_tokens: Sequence[int]) -> None:
        """`grammars[i].rollback(num_tokens[i])` for all i; engines override to batch it."""

    def destroy(self) -> None:
        """Release threads and caches."""


class TokenHistory:
    """Counts accepted tokens so `rollback(n)` can be checked before the engine sees it."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def check_rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.count:
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {self.count} were accepted")


class BaseGrammarBackend:
    """Shared plumbing for GrammarBackend implementations: bitmask allocation, the per-grammar
    batch loops, and a fill loop that spreads large batches over a thread pool (worth it only for
    engines that release the GIL)."""

    name: ClassVar[str] = "base"
    kinds: ClassVar[frozenset[str]] = frozenset()
    parallel_fill_threshold: ClassVar[int] = 128  # vLLM's cut-off: below it threads cost more than they save
    parallel_fill_chunk: ClassVar[int] = 16

    def __init__(self, *, vocab_size: int, fill_workers: int | None = None) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self._fill_workers = fill_workers
        self._fill_pool: ThreadPoolExecutor | None = None

    def allocate_token_bitmask(self, num_rows: int) -> torch.Tensor:
        return allocate_token_bitmask(num_rows, self.vocab_size)

    def fill_bitmasks(self, grammars: Sequence[Grammar], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        if len(grammars) < self.parallel_fill_threshold or self._fill_workers == 1:
            for grammar, row in zip(grammars, rows):
                grammar.fill_bitmask(bitmask, row)
            return
        if self._fill_pool is None:
            self._fill_pool = ThreadPoolExecutor(max_workers=self._fill_workers, thread_name_prefix=f"{self.name}-fill")
        step = self.parallel_fill_chunk

        def fill_chunk(start: int) -> None:
            for grammar, row in zip(grammars[start : start + step], rows[start : start + step]):
                grammar.fill_bitmask(bitmask, row)

        # list() re-raises the first worker exception here.
        list(self._fill_pool.map(fill_chunk, range(0, len(grammars), step)))

    def accept_batch(self, grammars: Sequence[Grammar], tokens: Sequence[int]) -> list[bool]:
        return [grammar.accept_tokens((token,)) for grammar, token in zip(grammars, tokens)]

    def rollback_batch(self, grammars: Sequence[Grammar], num_tokens: Sequence[int]) -> None:
        for grammar, n in zip(grammars, num_tokens):
            grammar.rollback(n)

    def destroy(self) -> None:
        if self._fill_pool is not None:
            self._fill_pool.shutdown(wait=True)
            self._fill_pool = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} V={self.vocab_size}>"
