"""xgrammar as a grammar backend: JSON schema, json_object, regex, EBNF, choice and structural tags.

Compilation goes through one `xgrammar.GrammarCompiler` (thread-safe, with its own cache); every
request gets its own `GrammarMatcher`. Batches of rows are filled with `BatchGrammarMatcher`, which
spreads them over C++ threads without the GIL.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import xgrammar as xgr

from .. import envs
from .forced import ForcedTokens, xgrammar_forced_tokens
from .grammar import BaseGrammarBackend, Grammar, TokenHistory
from .registry import register_grammar_backend

logger = logging.getLogger(__name__)

__all__ = ["CACHE_LIMIT_ENV", "DEFAULT_CACHE_LIMIT_BYTES", "XGrammarBackend", "XGrammarGrammar"]

# xgrammar's compiler cache is unbounded unless told otherwise: every distinct schema a server sees
# stays in memory. Bounded by default, at vLLM's default (VLLM_XGRAMMAR_CACHE_MB=512).
DEFAULT_CACHE_LIMIT_BYTES = 512 * 1024 * 1024
CACHE_LIMIT_ENV = "LOGITGATE_XGRAMMAR_CACHE_MB"

# "[12:00:00] /project/cpp/regex_converter.cc:83: " and "Check failed: (...) is false: " say nothing to a user.
_LOCATION = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")
_CHECK = re.compile(r"^Check failed: .*? is false:\s*")


def clean_xgrammar_error(exc: BaseException) -> str:
    """xgrammar's message without the C++ source location, first line only."""
    text = str(exc).strip()
    text = _CHECK.sub("", _LOCATION.sub("", text))
    return text.splitlines()[0] if text else type(exc).__name__


class XGrammarGrammar:
    """One request's xgrammar matcher. Rollback depth is unlimited in xgrammar 0.2.8
    (`max_rollback_tokens` is deprecated there), so accepted tokens are counted here to check it."""

    __slots__ = ("compiled", "matcher", "vocab_size", "special_ids", "_history")

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, special_ids: frozenset[int]) -> None:
        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.special_ids = special_ids
        self._history = TokenHistory()

    def _advance(self, tokens: Sequence[int]) -> int:
        """Accept tokens until one is rejected; how many were accepted (the caller rolls back)."""
        matcher = self.matcher
        if matcher.is_terminated():
            return 0
        last = len(tokens) - 1
        for i, token in enumerate(tokens):
            token = int(token)
            # Range and special ids are checked here so xgrammar does not log a warning per rejected draft.
            if not 0 <= token < self.vocab_size or token in self.special_ids or not matcher.accept_token(token):
                return i
            if i < last and matcher.is_terminated():  # nothing follows a stop token
                return i + 1
        return len(tokens)

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        accepted = self._advance(tokens)
        if accepted < len(tokens):
            if accepted:
                self.matcher.rollback(accepted)
            return False
        self._history.count += accepted
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> list[int]:
        accepted = self._advance(tokens)
        if accepted:
            self.matcher.rollback(accepted)
        return [int(t) for t in tokens[:accepted]]

    def rollback(self, num_tokens: int) -> None:
        self._history.check_rollback(num_tokens)
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self._history.count -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def forced(self, max_tokens: int, encode=None) -> ForcedTokens:
        """What the grammar fixes next (structured/forced.py): mask-forced tokens, then the
        tokenization `encode` gives of the jump-forward string (none without encode)."""
        return xgrammar_forced_tokens(self.matcher, encode, max_tokens, vocab_size=self.vocab_size)

    def reset(self) -> None:
        self.matcher.reset()
        self._history.count = 0

    def fresh(self) -> XGrammarGrammar:
        return XGrammarGrammar(self.compiled, self.vocab_size, self.special_ids)

    def fork(self) -> XGrammarGrammar:
        """An independent copy at the same state (beams, n > 1): xgrammar copies the parse state."""
        twin = XGrammarGrammar.__new__(XGrammarGrammar)
        twin.compiled, twin.vocab_size, twin.special_ids = self.compiled, self.vocab_size, self.special_ids
        twin.matcher = self.matcher.fork()
        twin._history = TokenHistory()
        twin._history.count = self._history.count
        return twin

    @property
    def num_accepted_tokens(self) -> int:
        return self._history.count


class XGrammarBackend(BaseGrammarBackend):
    """Compiles with `xgrammar.GrammarCompiler` over an `xgrammar.TokenizerInfo`."""

    name = "xgrammar"
    kinds = frozenset({"json", "json_object", "regex", "grammar", "choice", "structural_tag"})

    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo | None = None,
        *,
        vocab_size: int,
        compile_threads: int = 8,
        fill_threads: int | str = "auto",
        cache_limit_bytes: int | None = None,
    ) -> None:
        """cache_limit_bytes: the compiler cache's bound (least recently used grammars dropped
        first); None: $LOGITGATE_XGRAMMAR_CACHE_MB megabytes if set, else 512 MB; -1: unbounded."""
        if tokenizer_info is None:
            raise ValueError(
                "the xgrammar backend needs tokenizer_info (an xgrammar.TokenizerInfo, e.g. "
                "xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=...))"
            )
        if not isinstance(tokenizer_info, xgr.TokenizerInfo):
            raise ValueError(f"tokenizer_info must be an xgrammar.TokenizerInfo, got {type(tokenizer_info).__name__}")
        if tokenizer_info.vocab_size != vocab_size:
            raise ValueError(
                f"tokenizer_info.vocab_size is {tokenizer_info.vocab_size} but vocab_size is {vocab_size}; "
                "build the TokenizerInfo with the model's (padded) vocab_size"
            )
        cache_limit_bytes = resolve_cache_limit(cache_limit_bytes)
        super().__init__(vocab_size=vocab_size)
        self.tokenizer_info = tokenizer_info
        # Special and padding ids: xgrammar never accepts them (and warns when asked).
        self.special_ids = frozenset(int(t) for t in tokenizer_info.special_token_ids)
        self.compiler = xgr.GrammarCompiler(
            tokenizer_info, max_threads=compile_threads, cache_enabled=True, cache_limit_bytes=cache_limit_bytes
        )
        self._batch = xgr.BatchGrammarMatcher(fill_threads)

    def compile(self, kind: str, spec: Any, *, disable_any_whitespace: bool = False) -> XGrammarGrammar:
        if kind not in self.kinds:
            raise ValueError(f"the xgrammar backend cannot compile {kind!r} constraints")
        try:
            compiled = self._compile(kind, spec, any_whitespace=not disable_any_whitespace)
        except (RuntimeError, xgr.InvalidJSONError, xgr.InvalidStructuralTagError, TypeError) as exc:
            # xgrammar raises RuntimeError with a C++ location prefix; keep the reason only.
            raise ValueError(f"invalid {kind} constraint: {clean_xgrammar_error(exc)}") from exc
        return XGrammarGrammar(compiled, self.vocab_size, self.special_ids)

    def _compile(self, kind: str, spec: Any, *, any_whitespace: bool) -> xgr.CompiledGrammar:
        if kind == "json":
            schema = json.dumps(spec) if isinstance(spec, Mapping) else spec
            return self.compiler.compile_json_schema(schema, any_whitespace=any_whitespace)
        if kind == "json_object":
            # vLLM's json_object: any JSON object (strict mode only forbids undeclared properties
            # when properties are declared, so '{"type": "object"}' allows any).
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        if kind == "grammar":
            return self.compiler.compile_grammar(spec)
        if kind == "choice":
            return self.compiler.compile_grammar(choice_ebnf(spec))
        # structural_tag: a dict, a StructuralTag or its JSON string.
        tag = json.dumps(spec) if isinstance(spec, Mapping) else spec
        return self.compiler.compile_structural_tag(tag)

    def fill_bitmasks(self, grammars: Sequence[Grammar], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        matchers = [g.matcher for g in grammars]  # type: ignore[attr-defined]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, list(rows))

    def accept_batch(self, grammars: Sequence[Grammar], tokens: Sequence[int]) -> list[bool]:
        # A plain loop: BatchGrammarMatcher.batch_accept_token converts its result element by element
        # through tvm-ffi, which costs more than the accepts. Ids xgrammar would refuse with a
        # warning never reach it.
        vocab_size, special, accepted = self.vocab_size, self.special_ids, []
        for grammar, token in zip(grammars, tokens):
            ok = 0 <= token < vocab_size and token not in special and grammar.matcher.accept_token(token)  # type: ignore[attr-defined]
            if ok:
                grammar._history.count += 1  # type: ignore[attr-defined]
            accepted.append(ok)
        return accepted

    def rollback_batch(self, grammars: Sequence[Grammar], num_tokens: Sequence[int]) -> None:
        for grammar, n in zip(grammars, num_tokens):
            grammar._history.check_rollback(n)  # type: ignore[attr-defined]
        xgr.BatchGrammarMatcher.batch_rollback([g.matcher for g in grammars], list(num_tokens))  # type: ignore[attr-defined]
        for grammar, n in zip(grammars, num_tokens):
            grammar._history.count -= n  # type: ignore[attr-defined]

    def destroy(self) -> None:
        self.compiler.clear_cache()
        super().destroy()


def resolve_cache_limit(cache_limit_bytes: int | None) -> int:
    """The compiler cache bound in bytes: the argument, else the environment, else the default."""
    if cache_limit_bytes is None:
        raw = envs.read(CACHE_LIMIT_ENV)
        if raw is None or not raw.strip():
            return DEFAULT_CACHE_LIMIT_BYTES
        try:
            megabytes = int(raw)
        except ValueError:
            raise ValueError(f"{CACHE_LIMIT_ENV}={raw!r} is not an integer number of megabytes (-1: unbounded)") from None
        if megabytes != -1 and megabytes <= 0:
            raise ValueError(f"{CACHE_LIMIT_ENV}={raw!r} must be a positive number of megabytes or -1 (unbounded)")
        return -1 if megabytes == -1 else megabytes * 1024 * 1024
    if isinstance(cache_limit_bytes, bool) or not isinstance(cache_limit_bytes, int) or (
        cache_limit_bytes != -1 and cache_limit_bytes <= 0
    ):
        raise ValueError(f"cache_limit_bytes must be a positive int or -1 (unbounded), got {cache_limit_bytes!r}")
    return cache_limit_bytes


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`. JSON string escapes are valid xgrammar
    EBNF literals, so json.dumps quotes each choice (quotes, backslashes, control characters)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


register_grammar_backend("xgrammar", XGrammarBackend)
