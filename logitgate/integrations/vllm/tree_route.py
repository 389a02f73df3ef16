"""Route tree requests through vLLM's structured-output machinery (installed by the plugin).

Three patches, each at the one place vLLM looks the name up at call time:
- front end, `InputProcessor._validate_params`: resolve and compile the request's tree (names,
  the server-wide tree, token ids checked against the model's vocabulary). A malformed tree is a
  `VLLMValidationError` for that request alone (HTTP 400 on the server); a tree together with
  vLLM's own `structured_outputs` is refused (a request decodes under one constraint).
- engine, `StructuredOutputRequest.from_sampling_params` (called by `Request.__init__`): a tree
  request becomes a structured-output request (`TreeOutputRequest`), so the scheduler sends its
  bitmask rows, drafts included, and advances / rolls back its grammar; the tree's end token is
  added to the request's stop tokens (the walk is finished there, so decoding must stop).
- engine, `StructuredOutputManager.grammar_init`: compiles a tree request with logitgate (the
  manager's own backend serves vLLM's json/regex/grammar requests alongside); a tree that fails
  to compile fails that request alone through vLLM's grammar-error path, never unconstrained.

Nothing here imports torch or numba at install time; the tree machinery loads with the first tree
request.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

from .tree_args import tree_request_for

__all__ = ["install", "is_installed"]

# A child of vLLM's logger, so a tree that fails in the engine shows in vLLM's log.
logger = logging.getLogger("vllm.logitgate")

_installed = False


def is_installed() -> bool:
    """True in a process where tree requests are served as structured outputs (the logits
    processors then leave them alone, so no tree is applied twice)."""
    return _installed


def _front_end_check(params: Any, vocab_size: int) -> None:
    """ValueError naming the problem; compiles the tree (cached) so the engine's copy is valid."""
    request = tree_request_for(params)
    if request is None:
        return
    structured = getattr(params, "structured_outputs", None)
    if structured is not None and not structured.all_constraints_none():
        raise ValueError(
            "a request cannot combine a logitgate tree (extra_args) with structured_outputs: it decodes under one constraint"
        )
    request.compile(vocab_size, device="cpu", eos_token_id=getattr(params, "eos_token_id", None))


def _patch_input_processor() -> str:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_params

    def _validate_params(self: Any, params: Any, supported_tasks: Any) -> Any:
        result = original(self, params, supported_tasks)
        if isinstance(params, SamplingParams):
            try:
                _front_end_check(params, self.model_config.get_vocab_size())
            except ValueError as err:
                raise VLLMValidationError(f"logitgate tree decode: {err}") from err
        return result

    _validate_params.__wrapped__ = original  # type: ignore[attr-defined]
    InputProcessor._validate_params = _validate_params
    return "InputProcessor._validate_params (tree requests checked and compiled at admission)"


def _patch_request_creation() -> str:
    from vllm.v1.structured_output.request import StructuredOutputRequest

    original = StructuredOutputRequest.from_sampling_params

    def from_sampling_params(sampling_params: Any) -> Any:
        try:
            request = tree_request_for(sampling_params) if sampling_params is not None else None
        except ValueError as err:  # the front end checks first; keep the request failing, not unconstrained
            request, error = None, err
        else:
            error = None
            if request is None:
                return original(sampling_params)
        from .tree_grammar import TreeOutputRequest

        return TreeOutputRequest(request, error)

    StructuredOutputRequest.from_sampling_params = staticmethod(from_sampling_params)
    return "StructuredOutputRequest.from_sampling_params (tree requests become structured-output requests)"


def _tree_grammar(manager: Any, request: Any) -> Any:
    """The compiled grammar, or a Future holding the error (vLLM's contract for failed compiles)."""
    from .tree_grammar import compile_tree_grammar

    structured = request.structured_output_request
    try:
        if structured.error is not None:
            raise structured.error
        params = request.sampling_params
        grammar = compile_tree_grammar(
            structured.tree_request, manager.vllm_config.model_config.get_vocab_size(), params.eos_token_id
        )
        end = grammar.tree.end_token_id
        if end != params.eos_token_id and end not in (params.stop_token_ids or ()):
            params.stop_token_ids = [*(params.stop_token_ids or ()), end]
            params.all_stop_token_ids.add(end)
        return grammar
    except Exception as err:  # noqa: BLE001 - any failure fails this request alone
        logger.error("logitgate: tree request %s cannot be served: %s", request.request_id, err)
        failed: Future = Future()
        failed.set_exception(err)
        return failed


def _ensure_bitmask(manager: Any) -> None:
    """vLLM allocates the batch bitmask through its grammar backend, which a server with only tree
    requests never creates: allocate the same int32 (rows, ceil(V/32)) tensor here."""
    if manager._grammar_bitmask is None and manager.backend is None:
        import torch

        config = manager.vllm_config
        rows = config.scheduler_config.max_num_seqs * (1 + config.num_speculative_tokens)
        words = (config.model_config.get_vocab_size() + 31) // 32
        manager._grammar_bitmask = torch.full((rows, words), -1, dtype=torch.int32)


def _patch_grammar_init() -> str:
    from vllm.v1.structured_output import StructuredOutputManager

    original = StructuredOutputManager.grammar_init

    def grammar_init(self: Any, request: Any) -> None:
        from .tree_grammar import TreeOutputRequest

        if not isinstance(request.structured_output_request, TreeOutputRequest):
            return original(self, request)
        _ensure_bitmask(self)
        request.structured_output_request.grammar = _tree_grammar(self, request)

    StructuredOutputManager.grammar_init = grammar_init
    return "StructuredOutputManager.grammar_init (trees compiled by logitgate)"


def install() -> list[str]:
    """Install the three patches once per process; what was replaced, for the start-up log."""
    global _installed
    if _installed:
        return []
    replaced = [_patch_input_processor(), _patch_request_creation(), _patch_grammar_init()]
    _installed = True
    return replaced
