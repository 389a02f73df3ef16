"""StructuredOutputManager: compiles each request's constraint in a thread pool, builds the batch's
grammar bitmask (draft positions included) and advances the grammars as tokens are accepted.

It talks to grammar engines only through the GrammarBackend / Grammar protocols (structured/grammar.py);
which engine compiles a constraint is looked up in the registry by kind.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError  # not the builtin before 3.11
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import torch

from ..backends.formats import num_bitmask_words
from ..checks import as_positive_int, as_token_id, is_integer, short_repr
from .forced import ForcedTokens
from .grammar import Grammar, GrammarBackend
from .params import StructuredOutputsParams
from .reasoning import EndMarker
from .registry import get_grammar_backend_factory

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_KIND_BACKENDS", "RequestStatus", "StructuredOutputManager"]

# Which registered engine compiles each constraint kind unless the manager's `backend` covers it.
DEFAULT_KIND_BACKENDS: dict[str, str] = {
    "json": "xgrammar",
    "json_object": "xgrammar",
    "regex": "xgrammar",
    "grammar": "xgrammar",
    "choice": "xgrammar",
    "structural_tag": "xgrammar",
    "prefix_dict": "tree",
    "token_trie": "tree",
}


class RequestStatus(str, Enum):
    COMPILING = "compiling"
    READY = "ready"
    FAILED = "failed"


@dataclass(eq=False)
class _Request:
    request_id: str
    params: StructuredOutputsParams
    backend_name: str
    future: Future  # -> a template Grammar from the compile cache, never advanced itself
    gated: bool  # constraints wait for the reasoning end marker
    grammar: Grammar | None = None
    backend: GrammarBackend | None = None
    error: str | None = None
    marker_progress: int = 0
    reasoning_ended: bool = False
    reasoning_log: list[int] = field(default_factory=list)  # marker progress before each reasoning token
    grammar_tokens: int = 0  # tokens the grammar accepted (the ones after the reasoning span)
    # Guards the grammar and the reasoning fields: a grammar engine's matcher is not thread-safe, and
    # an async scheduler may overlap two steps over the same requests. One lock per request, so
    # calls over unrelated requests never wait for each other.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def constrained(self) -> bool:
        return not self.gated or self.reasoning_ended


@dataclass(eq=False, slots=True)
class _DraftWalk:
    """One request's trip through its draft tokens inside grammar_bitmask."""

    grammar: Grammar
    drafts: list[int]
    first_row: int
    marker_progress: int
    constrained: bool
    terminated: bool
    advanced: int = 0  # grammar steps taken, rolled back at the end


class StructuredOutputManager:
    """Per-request grammars for a running batch.

    Args:
        tokenizer_info: an `xgrammar.TokenizerInfo` (needed for json / json_object / regex / grammar /
            choice / structural_tag; tree constraints do without, except that a token_trie's end
            token defaults to its first stop token).
        vocab_size: the model's (padded) vocabulary size; bitmasks have ceil(vocab_size / 32) words.
        num_speculative_tokens: the most draft tokens a request may have per step.
        max_workers: compile threads (default: half the CPU cores, at least 1).
        backend: the grammar engine for the kinds it supports, a registered name or a GrammarBackend
            instance (default "xgrammar"); other kinds use DEFAULT_KIND_BACKENDS.
        reasoning_end_token_ids: token ids that end the reasoning span (e.g. "</think>"); with it,
            constraints start after the marker unless enable_in_reasoning.
        enable_in_reasoning: constrain the reasoning span too (a request's params can override it).
        compile_cache_size: compiled constraints kept for reuse (least recently used dropped first).
        encode: the tokenizer as str -> token ids, no special tokens; `forced` tokenizes the
            strings a grammar fixes with it (None: only tokens the mask forces are proposed).
    """

    def __init__(
        self,
        tokenizer_info: Any = None,
        *,
        vocab_size: int,
        num_speculative_tokens: int = 0,
        max_workers: int | None = None,
        backend: str | GrammarBackend | None = None,
        reasoning_end_token_ids: Sequence[int] | None = None,
        enable_in_reasoning: bool = False,
        compile_cache_size: int = 1024,
        encode: Callable[[str], Sequence[int]] | None = None,
    ) -> None:
        vocab_size = as_positive_int(vocab_size, "vocab_size")
        if not is_integer(num_speculative_tokens) or num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be a non-negative int, got {num_speculative_tokens!r}")
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        if compile_cache_size < 1:
            raise ValueError(f"compile_cache_size must be at least 1, got {compile_cache_size}")
        self.tokenizer_info = tokenizer_info
        self.encode = encode
        self.vocab_size = vocab_size
        self.num_speculative_tokens = num_speculative_tokens
        self.enable_in_reasoning = enable_in_reasoning
        self.reasoning_end = EndMarker(reasoning_end_token_ids) if reasoning_end_token_ids is not None else None
        if self.reasoning_end is not None:
            for t in self.reasoning_end.tokens:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"reasoning end marker token id {t} is outside the vocabulary [0, {vocab_size})")
        self._backends: dict[str, GrammarBackend] = {}
        self._preferred: str | None = None
        if isinstance(backend, str):
            get_grammar_backend_factory(backend)  # fail now on an unknown name
            self._preferred = backend
        elif backend is not None:
            if not isinstance(backend, GrammarBackend):
                raise ValueError(f"backend must be a registered name or a GrammarBackend, got {type(backend).__name__}")
            self._preferred = backend.name
            self._backends[backend.name] = backend
        workers = max_workers or max(1, (os.cpu_count() or 2) // 2)
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="logitgate-compile")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._cache_size = compile_cache_size
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._resolve_lock = threading.Lock()
        self._closed = False

    # ---- set-up ----

    def _backend_name_for(self, kind: str) -> str:
        if self._preferred is not None:
            preferred = self._backends.get(self._preferred)
            kinds = preferred.kinds if preferred is not None else getattr(get_grammar_backend_factory(self._preferred), "kinds", ())
            if kind in kinds:
                return self._preferred
        return DEFAULT_KIND_BACKENDS[kind]

    def _get_backend(self, name: str) -> GrammarBackend:
        with self._lock:
            backend = self._backends.get(name)
        if backend is not None:
            return backend
        # Built outside the lock (building compiles nothing but may import an engine).
        created = get_grammar_backend_factory(name)(tokenizer_info=self.tokenizer_info, vocab_size=self.vocab_size)
        with self._lock:
            backend = self._backends.setdefault(name, created)
        if backend is not created:
            created.destroy()
        return backend

    def _compile(self, name: str, params: StructuredOutputsParams) -> Grammar:
        backend = self._get_backend(name)
        return backend.compile(params.kind, params.spec, disable_any_whitespace=params.disable_any_whitespace)

    def add_request(
        self, request_id: str, params: StructuredOutputsParams, *, reasoning_ended: bool = False
    ) -> None:
        """Start compiling `params` for `request_id` (returns at once; see `status` / `wait`).

        reasoning_ended: the prompt already closed the reasoning span (e.g. thinking disabled).
        A constraint that fails to compile fails this request alone; `error()` says why.
        """
        if not isinstance(params, StructuredOutputsParams):
            raise ValueError(f"params for request {request_id!r} must be StructuredOutputsParams, got {type(params).__name__}")
        if self._closed:
            raise ValueError("the StructuredOutputManager is closed")
        name = self._backend_name_for(params.kind)
        key = (name, params.cache_key())
        enable = self.enable_in_reasoning if params.enable_in_reasoning is None else params.enable_in_reasoning
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already registered")
            future = self._cache.get(key)
            # The clean-up callback may not have run yet for a compile that just failed.
            new = future is None or not _reusable(future)
            if new:
                future = self._executor.submit(self._compile, name, params)
                self._cache[key] = future
                self._evict()
            else:
                self._cache.move_to_end(key)
            self._requests[request_id] = _Request(
                request_id,
                params,
                name,
                future,
                gated=self.reasoning_end is not None and not enable,
                reasoning_ended=reasoning_ended,
            )
        if new:
            # Outside the lock: a finished future runs the callback right here.
            future.add_done_callback(lambda f, key=key: self._forget_failure(key, f))

    def _evict(self) -> None:
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _forget_failure(self, key: tuple, future: Future) -> None:
        if not _reusable(future):
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def remove_request(self, request_id: str) -> None:
        """Forget a request (finished or aborted); unknown ids are ignored."""
        with self._lock:
            self._requests.pop(request_id, None)

    # ---- request lookup ----

    def _lookup(self, request_id: str) -> _Request:
        with self._lock:
            req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"request {request_id!r} has no structured-output constraint registered")
        return req

    def _resolve(self, req: _Request, timeout: float | None = None) -> bool:
        """Turn a finished compile into the request's grammar; True when ready."""
        if req.grammar is not None:
            return True
        if req.error is not None:
            return False
        try:
            template = req.future.result(timeout=timeout)
        except FutureTimeoutError:
            raise
        except Exception as exc:  # noqa: BLE001 - any compile failure fails this request only
            reason = str(exc) or type(exc).__name__
            with self._resolve_lock:
                if req.error is None:
                    req.error = reason
                    logger.warning("structured output for request %r failed to compile: %s", req.request_id, reason)
            return False
        backend = self._get_backend(req.backend_name)
        with self._resolve_lock:  # status() may race the decode loop here; only one grammar per request
            if req.grammar is None:
                req.backend = backend
                req.grammar = template.fresh()
        return True

    def _ready(self, request_id: str) -> _Request:
        """The request, compiled (waits for its compile); ValueError if it failed."""
        req = self._lookup(request_id)
        if not self._resolve(req):
            raise ValueError(f"request {request_id!r} has no usable constraint: {req.error}")
        return req

    def status(self, request_id: str) -> RequestStatus:
        """compiling / ready / failed, without waiting."""
        req = self._lookup(request_id)
        if req.grammar is None and req.error is None and not req.future.done():
            return RequestStatus.COMPILING
        return RequestStatus.READY if self._resolve(req) else RequestStatus.FAILED

    def is_ready(self, request_id: str) -> bool:
        return self.status(request_id) is RequestStatus.READY

    def wait(self, request_id: str, timeout: float | None = None) -> RequestStatus:
        """Block until the request's compile finished (TimeoutError after `timeout` seconds)."""
        req = self._lookup(request_id)
        return RequestStatus.READY if self._resolve(req, timeout) else RequestStatus.FAILED

    def error(self, request_id: str) -> str | None:
        """Why the request's constraint failed to compile (None while compiling or when it worked)."""
        req = self._lookup(request_id)
        if req.future.done():
            self._resolve(req)
        return req.error

    def request_ids(self) -> list[str]:
        with self._lock:
            return list(self._requests)

    # ---- token checks ----

    def _check_tokens(self, request_id: str, tokens: Sequence[int], *, allow_padding: bool = False) -> list[int]:
        where = f" of request {request_id!r}"
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
            raise ValueError(f"tokens{where} must be a list of token ids, got {type(tokens).__name__}")
        return [-1 if allow_padding and is_integer(t) and t == -1 else as_token_id(t, self.vocab_size, where) for t in tokens]

    def _split_reasoning(self, req: _Request, tokens: list[int]) -> tuple[list[int], list[int], int]:
        """(progress before each reasoning token, the tokens for the grammar, marker progress after)."""
        if req.constrained:
            return [], tokens, req.marker_progress
        assert self.reasoning_end is not None
        progress, befores = req.marker_progress, []
        for i, token in enumerate(tokens):
            befores.append(progress)
            progress = self.reasoning_end.step(progress, token)
            if progress == len(self.reasoning_end):
                return befores, tokens[i + 1 :], progress
        return befores, [], progress

    # ---- advancing ----

    def accept_tokens(self, request_id: str, tokens: Sequence[int]) -> bool:
        """Advance the request through tokens it emitted (after verification). All or nothing:
        False, with no state change, if the grammar rejects any of them."""
        req = self._ready(request_id)
        ids = self._check_tokens(request_id, tokens)
        with req.lock:
            return self._accept_locked(req, ids)

    def _accept_locked(self, req: _Request, ids: list[int]) -> bool:
        request_id = req.request_id
        befores, for_grammar, progress = self._split_reasoning(req, ids)
        if for_grammar:
            if not req.grammar.accept_tokens(for_grammar):
                logger.debug("request %r: grammar rejected tokens %s", request_id, for_grammar)
                return False
            req.grammar_tokens += len(for_grammar)
        if befores:
            req.reasoning_log.extend(befores)
            req.marker_progress = progress
            req.reasoning_ended = progress == len(self.reasoning_end)
        return True

    def validate_tokens(self, request_id: str, tokens: Sequence[int]) -> list[int]:
        """The longest prefix of `tokens` the request would accept; no state change. Tokens in the
        reasoning span are all valid; a token id outside the vocabulary ends the prefix."""
        req = self._ready(request_id)
        ids = [_integer_id(t, request_id) for t in tokens]
        end = next((i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size), len(ids))
        with req.lock:
            befores, for_grammar, _ = self._split_reasoning(req, ids[:end])
            if not for_grammar:
                return ids[: len(befores)]
            return ids[: len(befores)] + req.grammar.validate_tokens(for_grammar)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens, the reasoning span included."""
        req = self._ready(request_id)
        with req.lock:
            self._rollback_locked(req, num_tokens)

    def _rollback_locked(self, req: _Request, num_tokens: int) -> None:
        total = req.grammar_tokens + len(req.reasoning_log)
        if not 0 <= num_tokens <= total:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens of request {req.request_id!r}: only {total} were accepted"
            )
        from_grammar = min(num_tokens, req.grammar_tokens)
        if from_grammar:
            req.grammar.rollback(from_grammar)
            req.grammar_tokens -= from_grammar
        from_reasoning = num_tokens - from_grammar
        if from_reasoning:
            req.marker_progress = req.reasoning_log[-from_reasoning]
            del req.reasoning_log[-from_reasoning:]
            req.reasoning_ended = False

    def is_terminated(self, request_id: str) -> bool:
        req = self._ready(request_id)
        with req.lock:
            return req.constrained and req.grammar.is_terminated()

    def forced(self, request_id: str, max_tokens: int) -> ForcedTokens:
        """What the request's constraint fixes next, at most max_tokens (structured/forced.py):
        `tokens[:num_mask_forced]` may be committed unverified, the rest are drafts to verify.
        Nothing inside the reasoning span, nor from a grammar that cannot say."""
        req = self._ready(request_id)
        with req.lock:
            forced = getattr(req.grammar, "forced", None)
            if not req.constrained or forced is None or max_tokens <= 0:
                return ForcedTokens()
            return forced(max_tokens, self.encode)

    def reasoning_ended(self, request_id: str) -> bool:
        """True once the request's output passed the reasoning end marker (always True without one)."""
        req = self._lookup(request_id)
        return self.reasoning_end is None or req.reasoning_ended

    def validate_draft_tokens(self, spec_tokens: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
        """Drafts with every token from the first one the grammar rejects replaced by -1 (same
        lengths), so verification never accepts an invalid draft. Requests without a constraint
        pass through unchanged."""
        out: dict[str, list[int]] = {}
        for request_id, drafts in spec_tokens.items():
            ids = [_integer_id(t, request_id) for t in drafts]
            with self._lock:
                structured = request_id in self._requests
            if not structured:
                out[request_id] = ids
                continue
            valid = self.validate_tokens(request_id, ids)
            out[request_id] = valid + [-1] * (len(ids) - len(valid))
        return out

    # ---- the batch bitmask ----

    def _drafts_for(self, request_ids: Sequence[str], spec_tokens: Any) -> list[list[int]]:
        if spec_tokens is None:
            return [[] for _ in request_ids]
        if isinstance(spec_tokens, Mapping):
            raw = [spec_tokens.get(r, ()) for r in request_ids]
        else:
            raw = list(spec_tokens)
            if len(raw) != len(request_ids):
                raise ValueError(f"spec_tokens has {len(raw)} entries for {len(request_ids)} request ids")
        drafts = []
        for request_id, tokens in zip(request_ids, raw):
            ids = self._check_tokens(request_id, tokens, allow_padding=True)
            if len(ids) > self.num_speculative_tokens:
                raise ValueError(
                    f"request {request_id!r} has {len(ids)} draft tokens, more than num_speculative_tokens="
                    f"{self.num_speculative_tokens}"
                )
            drafts.append(ids)
        return drafts

    def grammar_bitmask(
        self, request_ids: Sequence[str], spec_tokens: Mapping[str, Sequence[int]] | Sequence[Sequence[int]] | None = None
    ) -> torch.Tensor:
        """Host int32 bitmask with 1 + len(drafts) rows per request, in `request_ids` order.

        Row k of a request is its mask after its first k drafts (the last is the bonus row). After
        the first draft the grammar rejects (or a -1 padding draft) the remaining rows repeat the
        last valid one. Rows in the reasoning span and rows of finished grammars allow everything.
        Every grammar is left as it was found. Waits for requests still compiling; a request whose
        compile failed, an unknown id or a bad draft raises ValueError before any state changes.
        """
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"request_ids has duplicates: {sorted({r for r in request_ids if list(request_ids).count(r) > 1})}")
        drafts = self._drafts_for(request_ids, spec_tokens)
        reqs = [self._ready(r) for r in request_ids]
        bitmask = _host_bitmask(sum(1 + len(d) for d in drafts), self.vocab_size)
        # The walk advances and rolls back every grammar of the batch: hold their locks throughout,
        # so a concurrent call over the same requests never sees (or steps) a half-walked grammar.
        with _holding(reqs):
            self._fill_batch(reqs, drafts, bitmask)
        return bitmask

    def _fill_batch(self, reqs: list[_Request], drafts: list[list[int]], bitmask: torch.Tensor) -> None:
        # Walks grouped by engine, so each depth is one batched fill and one batched accept per engine.
        groups: dict[int, tuple[GrammarBackend, list[_DraftWalk]]] = {}
        row = 0
        for req, d in zip(reqs, drafts):
            walk = _DraftWalk(req.grammar, d, row, req.marker_progress, req.constrained, req.grammar.is_terminated())
            groups.setdefault(id(req.backend), (req.backend, []))[1].append(walk)
            row += 1 + len(d)
        repeats: list[tuple[int, int, int]] = []  # (source row, first row, end row)
        try:
            for backend, walks in groups.values():
                self._walk_drafts(backend, walks, bitmask, repeats)
        finally:
            for backend, walks in groups.values():
                advanced = [w for w in walks if w.advanced]
                if advanced:
                    backend.rollback_batch([w.grammar for w in advanced], [w.advanced for w in advanced])
        for source, start, end in repeats:
            bitmask[start:end] = bitmask[source]

    def _walk_drafts(
        self, backend: GrammarBackend, walks: list[_DraftWalk], bitmask: torch.Tensor, repeats: list[tuple[int, int, int]]
    ) -> None:
        """Fill row k of every walk, then step over draft k, for k = 0, 1, ... A rejected or -1 draft
        ends a walk; its remaining rows will repeat its last row. Rows in the reasoning span or
        after the stop token stay all-allowed."""
        depth, active = 0, walks
        while active:
            fill = [w for w in active if w.constrained and not w.terminated]
            if fill:
                backend.fill_bitmasks([w.grammar for w in fill], bitmask, [w.first_row + depth for w in fill])
            still: list[_DraftWalk] = []
            stepping: list[_DraftWalk] = []
            for walk in active:
                if depth == len(walk.drafts):
                    continue
                token = walk.drafts[depth]
                if token == -1:
                    repeats.append((walk.first_row + depth, walk.first_row + depth + 1, walk.first_row + len(walk.drafts) + 1))
                elif not walk.constrained:
                    walk.marker_progress = self.reasoning_end.step(walk.marker_progress, token)
                    walk.constrained = walk.marker_progress == len(self.reasoning_end)
                    still.append(walk)
                elif walk.terminated:
                    still.append(walk)  # as vLLM: the rows after the stop token allow everything
                else:
                    stepping.append(walk)
            if stepping:
                accepted = backend.accept_batch([w.grammar for w in stepping], [w.drafts[depth] for w in stepping])
                for walk, ok in zip(stepping, accepted):
                    if ok:
                        walk.advanced += 1
                        walk.terminated = walk.grammar.is_terminated()
                        still.append(walk)
                    else:
                        repeats.append((walk.first_row + depth, walk.first_row + depth + 1, walk.first_row + len(walk.drafts) + 1))
            active, depth = still, depth + 1

    # ---- lifetime ----

    def close(self) -> None:
        """Stop the compile threads and release every engine."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            backends = list(self._backends.values())
            self._backends.clear()
        for backend in backends:
            backend.destroy()

    def __enter__(self) -> StructuredOutputManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<StructuredOutputManager V={self.vocab_size} requests={len(self._requests)} "
            f"engines={sorted(self._backends)} spec={self.num_speculative_tokens}>"
        )


def _integer_id(value: Any, request_id: str) -> int:
    """A token id that may lie outside the vocabulary (it then ends a valid prefix), but is an integer."""
    if not is_integer(value):
        raise ValueError(f"token id {short_repr(value)} of request {request_id!r} is not an integer")
    return int(value)


@contextmanager
def _holding(reqs: Sequence[_Request]) -> Iterator[None]:
    """Hold the locks of `reqs`, taken in request-id order so that two calls over overlapping
    batches cannot deadlock."""
    with ExitStack() as stack:
        for req in sorted(reqs, key=lambda r: r.request_id):
            stack.enter_context(req.lock)
        yield


def _reusable(future: Future) -> bool:
    """Whether a cached compile may serve another request. An invalid constraint (ValueError) fails
    the same way every time, so it stays cached; any other failure (memory, a crashed engine) or a
    cancelled compile is retried by the next request."""
    if not future.done():
        return True
    if future.cancelled():
        return False
    exc = future.exception()
    return exc is None or isinstance(exc, ValueError)


def _host_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed host bitmask. numpy's single-threaded fill: for a few MB, torch's intra-op
    thread hand-off costs more than the memset itself, and far more on a busy host."""
    return torch.from_numpy(np.full((rows, num_bitmask_words(vocab_size)), -1, dtype=np.int32))
