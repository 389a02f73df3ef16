"""The worker's copies of the scheduler's grammars, for `sample_first` across processes.

With vLLM's defaults the scheduler (engine-core process) owns the grammars and the model runner
samples in a worker process of its own. A row can only sample before its mask is filled where the
process that samples can check the token and settle a rejected row under the grammar. With one
worker (world size 1) the worker keeps a mirror of a request's grammar when the scheduler asks:

- in the scheduler's grammar backend (the scheduler names it with the request: vLLM's manager
  compiles every request with the backend of the first one it saw, whatever the request itself
  asked for), built by vLLM's own `StructuredOutputManager.grammar_init` in the worker, one
  manager per backend (same backend class, tokenizer, spec, stop tokens and bitmask width);
- built and compiled in the background, on a thread of its own: the first mirror of a backend
  builds vLLM's grammar backend (xgrammar's TokenizerInfo over the vocabulary: 1.4 s for 128k
  tokens), on vLLM's manager built at the worker's start-up (`prepare`: the tokenizer loaded, as
  vLLM loads the scheduler's). Built in `sample_tokens`, they stopped every stream for 3.7 s
  (issue 36, defect 4). The worker reports the mirror ready (or failed, with why) on a
  later output, and only then does the scheduler defer the request's rows to it. No step waits
  for a build or a compile, and a grammar the worker cannot build never gets a row;
- advanced only with tokens the scheduler's grammar has accepted: the scheduler ships, with each
  deferred row, the request's output tokens since the last ones it shipped, and where they start.
  The mirror checks that start against what it has taken in, and accepts them; one that cannot
  is dropped (MirrorError), never used out of step;
- dropped as soon as its request leaves the model runner (every step prunes to the runner's live
  requests), so a worker holds at most one mirror per running request.
"""
from __future__ import annotations

import copy
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from .. import metrics

__all__ = ["GrammarMirrors", "MirrorError"]

logger = logging.getLogger("vllm.logitgate.sample_first")


class MirrorError(RuntimeError):
    """A mirror that cannot stand in for the scheduler's grammar (missing, out of step, refusing)."""


class GrammarMirrors:
    """Request id -> [grammar or Future of one, tokens taken in], for one model runner."""

    def __init__(self, vllm_config: Any):
        self._config = vllm_config
        self._managers: dict[str, Any] = {}  # backend name -> vLLM's manager compiling with it
        self._lock = threading.Lock()
        self._mirrors: dict[str, list[Any]] = {}
        self._ready: list[str] = []
        self._failed: dict[str, str] = {}
        self._builder: ThreadPoolExecutor | None = None  # builds managers and starts compiles off the steps
        self._prepared: Any = None  # a manager built at start-up (`prepare`), for the first backend

    def __len__(self) -> int:
        return len(self._mirrors)

    def prepare(self) -> None:
        """At the worker's start-up (worker_startup.py, through worker.prepare_mirrors): vLLM's
        manager built ahead, its tokenizer loaded, as vLLM builds the scheduler's at start-up.
        Loading a 128k tokenizer holds the GIL for seconds, beside the steps too; the first
        mirror's grammar backend (xgrammar's TokenizerInfo, on the builder thread) then delays the
        worker's steps by under 30 ms at a time (a stack sampler, 2-core host).
        A manager that cannot be built here is built (and its failure reported) on demand."""
        if self._prepared is not None or self._managers:
            return
        from vllm.v1.structured_output import StructuredOutputManager

        try:
            self._prepared = StructuredOutputManager(self._config)
        except Exception:  # noqa: BLE001 - the first mirror tries again, and reports why
            logger.warning("logitgate sample_first: the worker's grammar manager could not be built at start-up; "
                           "the first mirror builds it", exc_info=True)

    def _manager(self, backend: str) -> Any:
        manager = self._managers.get(backend)
        if manager is None:
            from vllm.v1.structured_output import StructuredOutputManager

            # The manager built at start-up serves the first backend (each builds its own grammar backend).
            prepared, self._prepared = self._prepared, None
            manager = self._managers[backend] = prepared or StructuredOutputManager(self._config)
        return manager

    def start(self, req_id: str, backend: str, params: Any) -> None:
        """Begin building `req_id`'s grammar with `backend` in the background (a no-op for one
        already mirrored); a grammar that cannot be built is reported failed by `settle`."""
        if req_id in self._mirrors or req_id in self._failed:
            return
        params = copy.copy(params)
        params.structured_outputs = copy.copy(params.structured_outputs)
        params.structured_outputs._backend = backend  # what the scheduler's manager compiles with
        done: Future = Future()
        if self._builder is None:
            self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logitgate-mirror")
        self._builder.submit(self._build, req_id, backend, params, done)
        self._mirrors[req_id] = [done, 0]
        metrics.add("sample_first_mirrors_started")

    def _build(self, req_id: str, backend: str, params: Any, done: Future) -> None:
        """On the builder thread: vLLM's `grammar_init` (the backend's manager built first when new),
        its compile's outcome passed on to `done`."""
        try:
            from vllm.v1.structured_output.request import StructuredOutputRequest

            structured = StructuredOutputRequest.from_sampling_params(params)
            if structured is None:
                raise MirrorError("the request has no structured output in the worker")
            request = SimpleNamespace(request_id=req_id, sampling_params=params, structured_output_request=structured,
                                      use_structured_output=True)
            with self._lock:
                self._manager(backend).grammar_init(request)
        except Exception as err:  # noqa: BLE001 - reported to the scheduler, which then fills the request's rows
            done.set_exception(err)
            return
        grammar = structured._grammar
        if not isinstance(grammar, Future):  # compiled in place (vLLM's synchronous compile)
            done.set_result(grammar)
            return

        def passed_on(compiled: Future) -> None:
            error = compiled.exception()
            done.set_exception(error) if error is not None else done.set_result(compiled.result())

        grammar.add_done_callback(passed_on)

    def settle(self) -> tuple[tuple[str, ...], dict[str, str]]:
        """The mirrors that finished compiling since the last call, and the ones that failed (with
        why); failed ones are dropped."""
        for req_id, mirror in list(self._mirrors.items()):
            grammar = mirror[0]
            if not isinstance(grammar, Future) or not grammar.done():
                continue
            error = grammar.exception()
            if error is not None:
                self._failed[req_id] = f"{type(error).__name__}: {error}"
                self._drop(req_id)
            else:
                mirror[0] = grammar.result()
                self._ready.append(req_id)
        ready, failed = tuple(self._ready), self._failed
        self._ready, self._failed = [], {}
        return ready, failed

    def keep_only(self, live: Any) -> None:
        """Drop the mirrors of requests no longer in the runner (`live`: its request ids)."""
        for req_id in [r for r in self._mirrors if r not in live]:
            self._drop(req_id)

    def _drop(self, req_id: str) -> None:
        del self._mirrors[req_id]
        metrics.add("sample_first_mirrors_dropped")

    def catch_up(self, req_id: str, start: int, tokens: tuple[int, ...]) -> Any:
        """The mirror of `req_id` advanced to the scheduler's grammar: `tokens` are the output
        tokens from position `start` on that the scheduler's grammar accepted since it last shipped
        any. MirrorError (and the mirror dropped) where it cannot follow."""
        mirror = self._mirrors.get(req_id)
        if mirror is None or isinstance(mirror[0], Future):
            raise MirrorError(f"the worker has no compiled mirror of request {req_id}'s grammar")
        grammar, taken = mirror
        if start != taken:
            self._drop(req_id)
            raise MirrorError(f"the worker's mirror of request {req_id} has taken {taken} tokens, the scheduler's "
                              f"grammar {start}")
        if tokens and not grammar.accept_tokens(req_id, list(tokens)):
            self._drop(req_id)
            raise MirrorError(f"the worker's mirror of request {req_id} refused tokens {list(tokens)} its scheduler "
                              "accepted")
        mirror[1] = taken + len(tokens)
        return grammar
