"""The worker's copies of the scheduler's grammars, for `sample_first` across processes.

With vLLM's defaults the scheduler (engine-core process) owns the grammars and the model runner
samples in a worker process of its own. A row can only sample before its mask is filled where the
process that samples can check the token and settle a rejected row under the grammar. With one
worker (world size 1) the worker keeps a mirror of each structured request's grammar:

- built by vLLM's own `StructuredOutputManager.grammar_init` in the worker (same backend class,
  same tokenizer, same spec, same stop tokens; logitgate's trees through the same patched
  `grammar_init`), compiled in the background from the step the request arrives;
- advanced only with tokens the scheduler's grammar has accepted: the scheduler ships, with each
  deferred row, the request's output tokens since the last ones it shipped, and where they start.
  The mirror checks that start against what it has taken in, and accepts them (refusing one is
  an error, never a silent drift). So a mirror is in the scheduler grammar's state by
  construction, whatever the worker's own bookkeeping does.

Mirrors of finished requests are dropped with the step that reports them finished.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

__all__ = ["GrammarMirrors"]


class GrammarMirrors:
    """Request id -> [grammar or Future of one, tokens taken in], for one model runner."""

    def __init__(self, vllm_config: Any):
        self._config = vllm_config
        self._manager: Any = None
        self._lock = threading.Lock()
        self._mirrors: dict[str, list[Any]] = {}

    def _grammar_manager(self) -> Any:
        if self._manager is None:
            from vllm.v1.structured_output import StructuredOutputManager

            self._manager = StructuredOutputManager(self._config)
        return self._manager

    def start(self, req_id: str, params: Any) -> None:
        """Begin compiling the grammar of a request that arrived in the worker (a no-op for
        requests without structured output, and for ones already mirrored)."""
        if req_id in self._mirrors or params is None:
            return
        from vllm.v1.structured_output.request import StructuredOutputRequest

        structured = StructuredOutputRequest.from_sampling_params(params)
        if structured is None:
            return
        request = SimpleNamespace(request_id=req_id, sampling_params=params, structured_output_request=structured,
                                  use_structured_output=True)
        with self._lock:
            self._grammar_manager().grammar_init(request)
        self._mirrors[req_id] = [structured._grammar, 0]

    def drop(self, req_ids: Any) -> None:
        for req_id in req_ids or ():
            self._mirrors.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._mirrors)

    def grammar(self, req_id: str, params: Any, start: int, tokens: list[int]) -> Any:
        """The mirror of `req_id` advanced to the scheduler's grammar: `tokens` are the output
        tokens from position `start` on that the scheduler's grammar accepted since it last
        shipped any."""
        self.start(req_id, params)
        mirror = self._mirrors.get(req_id)
        if mirror is None:
            raise RuntimeError(f"logitgate sample_first: request {req_id} has no structured output in the worker")
        grammar, taken = mirror
        if isinstance(grammar, Future):
            grammar = mirror[0] = grammar.result()  # the scheduler compiled the same spec: it compiles
        if start != taken:
            raise RuntimeError(
                f"logitgate sample_first: the worker's grammar of request {req_id} has taken {taken} tokens, "
                f"the scheduler's {start}: refusing to sample it unmasked")
        if tokens and not grammar.accept_tokens(req_id, list(tokens)):
            raise RuntimeError(f"logitgate sample_first: the worker's grammar of request {req_id} refused "
                               f"tokens {list(tokens)} its scheduler accepted")
        mirror[1] = taken + len(tokens)
        return grammar
