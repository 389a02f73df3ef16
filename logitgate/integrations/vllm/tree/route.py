"""Route tree requests through vLLM's structured-output machinery (installed by the plugin).

The replacements below are rows of the patch table (patches.py: op `tree`, and `always` for the
admission and beam-search checks), each at the one place vLLM looks the name up at call time:
- front end, `InputProcessor.process_inputs`: after vLLM's own checks, resolve the request's tree
  (names, the server-wide tree) and admit it (admission.py: parsed, token ids checked against
  the model's vocabulary, the operator's size limits; never compiled, nothing kept). A bad tree is
  a `VLLMValidationError` for that request alone (HTTP 400 on the server); a tree together with
  vLLM's own `structured_outputs` is refused (a request decodes under one constraint). A prompt
  that does not end in a prefix dict's start token is warned about here, once per request. With
  LOGITGATE_VLLM_OPS leaving out `tree`, only this patch is installed and refuses tree requests
  (unless a logitgate logits processor is configured to serve them).
- front end, `AsyncLLM.add_request` (the API server's path to process_inputs, which it calls on its
  event loop): the tree is admitted first on a worker thread, a large one parsed in the admission
  process (admission.admission), and the outcome handed to process_inputs' admission, so no
  parse runs on the event loop.
- engine, `StructuredOutputRequest.from_sampling_params` (called by `Request.__init__`): a tree
  request becomes a structured-output request (`TreeOutputRequest`), so the scheduler sends its
  bitmask rows, drafts included, and advances / rolls back its grammar; the tree's end token is
  added to the request's stop tokens (the walk is finished there, so decoding must stop).
- engine, `StructuredOutputManager.grammar_init`: compiles a tree request with logitgate (the
  manager's own backend serves vLLM's json/regex/grammar requests alongside); a tree that fails
  to compile fails that request alone through vLLM's grammar-error path, never unconstrained.

Beam search is refused for a request under a tree (`to_beam_search_params` of vLLM's request
classes): vLLM runs each beam step as a new request built without extra_args, so the tree would be
silently dropped. `n` > 1 copies the request's params (extra_args included) and is served.

Nothing here imports torch or numba at install time; the tree machinery loads with the first tree
request.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .... import envs
from .. import patching
from ..patching import mark_replacement
from .args import GLOBAL_TREE_ENV, TREE_KEYS, tree_request_for

__all__ = [
    "add_request_replacement", "beam_search_replacement", "from_sampling_params_replacement", "grammar_init_replacement", "is_installed",
    "process_inputs_replacement", "to_beam_search_params_replacement",
]

# A child of vLLM's logger, so a tree that fails in the engine shows in vLLM's log.
logger = logging.getLogger("vllm.logitgate")

_NOT_SERVED = (
    "this server does not serve logitgate trees: the plugin runs with LOGITGATE_VLLM_OPS={ops!r}, which leaves out "
    "'tree', and no logitgate TreeDecode logits processor is configured; the request is refused rather than "
    "decoded unconstrained"
)


def is_installed() -> bool:
    """True in a process where tree requests are served as structured outputs (the `tree` rows of
    the patch table are in place; the logits processors then leave them alone, so no tree is
    applied twice)."""
    module = sys.modules.get("vllm.v1.structured_output.request")  # installing the rows imported it
    replaced = getattr(getattr(module, "StructuredOutputRequest", None), "from_sampling_params", None)
    return patching.is_replacement(replaced)


def _has_tree_processor(model_config: Any) -> bool:
    """Whether vLLM loads one of logitgate's TreeDecode logits processors (`--logits-processors`)."""
    for proc in getattr(model_config, "logits_processors", None) or ():
        name = proc if isinstance(proc, str) else f"{proc.__module__}:{proc.__qualname__}"
        module, _, cls = name.replace(":", ".").rpartition(".")
        if module.startswith("logitgate.") and cls.startswith("TreeDecode"):
            return True
    return False


def _front_end_check(params: Any, vocab_size: Callable[[], int], served: bool = True) -> Any:
    """The admitted tree's shape (admission.TreeShape), or None for a request without a tree;
    ValueError naming the problem. Only a tree request pays for anything (the vocabulary size is
    asked for then)."""
    request = tree_request_for(params)
    if request is None:
        return None
    if not served:
        raise ValueError(_NOT_SERVED.format(ops=envs.read("LOGITGATE_VLLM_OPS") or ""))
    structured = getattr(params, "structured_outputs", None)
    if structured is not None and not structured.all_constraints_none():
        raise ValueError(
            "a request cannot combine a logitgate tree (extra_args) with structured_outputs: it decodes under one constraint"
        )
    from .admission import admit

    return admit(request, vocab_size(), getattr(params, "eos_token_id", None))


def _warn_prompt_start(shape: Any, prompt_ids: Any, request_id: str) -> None:
    """Once per request, in the front end: RTP-LLM's tree starts after its start token."""
    if shape.start_token_id is None or prompt_ids is None:
        return
    from ....structured.tree.prompt import prompt_start_problem

    problem = prompt_start_problem(shape, prompt_ids)
    if problem is not None:
        logger.warning("logitgate: tree request %s: %s", request_id, problem)


def process_inputs_replacement(original: Callable, name: str) -> Callable:
    """InputProcessor.process_inputs: vLLM's own checks, then the request's tree admitted (served
    when this process serves trees, else refused unless a logitgate logits processor serves it)."""
    from vllm.exceptions import VLLMValidationError

    def process_inputs(self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        engine_request = original(self, request_id, prompt, params, *args, **kwargs)
        sampling = engine_request.sampling_params  # the request's own copy, with the model's eos
        if sampling is not None:
            served = is_installed()
            try:
                shape = _front_end_check(
                    sampling, self.model_config.get_vocab_size, served or _has_tree_processor(self.model_config)
                )
            except ValueError as err:
                raise VLLMValidationError(f"logitgate tree decode: {err}", parameter="extra_args") from err
            if shape is not None and served:
                _warn_prompt_start(shape, engine_request.prompt_token_ids, request_id)
        return engine_request

    process_inputs.__wrapped__ = original  # type: ignore[attr-defined]
    return mark_replacement(process_inputs, original, name)


def _model_eos(engine: Any) -> int | None:
    """The eos token vLLM's process_inputs gives a request (the renderer's), or None."""
    try:
        return engine.input_processor.renderer.get_eos_token_id()
    except AttributeError:
        return None


async def _admission_ahead(engine: Any, params: Any) -> Any:
    """The tree of `params`, admitted off the event loop (admission.admission), or None: no
    tree, not served here, or a problem process_inputs will name itself."""
    if not is_installed():
        return None
    try:
        request = tree_request_for(params)
    except ValueError:
        return None
    if request is None:
        return None
    from .admission import admission

    return await admission(request, engine.model_config.get_vocab_size(), _model_eos(engine))


def add_request_replacement(original: Callable, name: str) -> Callable:
    """AsyncLLM.add_request: a tree request's tree admitted off the event loop before vLLM's own
    add_request calls process_inputs on it (which then finds it admitted)."""

    async def add_request(self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        from .admission import handed_over

        with handed_over(await _admission_ahead(self, params)):
            return await original(self, request_id, prompt, params, *args, **kwargs)

    return mark_replacement(add_request, original, name)


_BEAM_SEARCH_REFUSED = (
    "logitgate tree decode: beam search cannot be served under a tree (vLLM's beam search runs each step as a "
    "new request without extra_args, so the tree would be dropped); use n or best-of sampling, or no tree"
)


def _asks_for_tree(xargs: Any) -> bool:
    if envs.read(GLOBAL_TREE_ENV):
        return True
    return isinstance(xargs, dict) and any(xargs.get(key) is not None for key in TREE_KEYS)


def to_beam_search_params_replacement(original: Callable, name: str) -> Callable:
    """`to_beam_search_params` of vLLM's request classes (the API server imports them all before
    loading plugins): refused for a request under a tree (HTTP 400)."""
    from vllm.exceptions import VLLMValidationError

    def to_beam_search_params(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _asks_for_tree(getattr(self, "vllm_xargs", None)):
            raise VLLMValidationError(_BEAM_SEARCH_REFUSED, parameter="use_beam_search")
        return original(self, *args, **kwargs)

    return mark_replacement(to_beam_search_params, original, name)


def beam_search_replacement(original: Callable, name: str) -> Callable:
    """The offline `LLM.beam_search`: refused under the server-wide tree (its params carry no tree)."""
    from vllm.exceptions import VLLMValidationError

    def beam_search(self: Any, *args: Any, **kwargs: Any) -> Any:
        if envs.read(GLOBAL_TREE_ENV):
            raise VLLMValidationError(_BEAM_SEARCH_REFUSED, parameter="beam_search")
        return original(self, *args, **kwargs)

    return mark_replacement(beam_search, original, name)


def from_sampling_params_replacement(original: Callable, name: str) -> Callable:
    """StructuredOutputRequest.from_sampling_params (called by `Request.__init__`): a tree request
    becomes a structured-output request (TreeOutputRequest)."""

    def from_sampling_params(sampling_params: Any) -> Any:
        try:
            request = tree_request_for(sampling_params) if sampling_params is not None else None
        except ValueError as err:  # the front end checks first; keep the request failing, not unconstrained
            request, error = None, err
        else:
            error = None
            if request is None:
                return original(sampling_params)
        from .grammar import TreeOutputRequest

        return TreeOutputRequest(request, error)

    return mark_replacement(from_sampling_params, original, name)


def _tree_grammar(manager: Any, request: Any) -> Any:
    """The compiled grammar (with the tree's end token among the request's stop tokens); raises
    what makes the request unservable, logged in vLLM's log."""
    from .grammar import compile_tree_grammar

    structured = request.structured_output_request
    try:
        if structured.error is not None:
            raise structured.error
        params = request.sampling_params
        grammar = compile_tree_grammar(
            structured.tree_request, manager.vllm_config.model_config.get_vocab_size(), params.eos_token_id
        )
    except Exception as err:
        logger.error("logitgate: tree request %s cannot be served: %s", request.request_id, err)
        raise
    end = grammar.tree.end_token_id
    if end != params.eos_token_id and end not in (params.stop_token_ids or ()):
        params.stop_token_ids = [*(params.stop_token_ids or ()), end]
        params.all_stop_token_ids.add(end)
    return grammar


_compile_pool: ThreadPoolExecutor | None = None


def _grammar_future(manager: Any, request: Any) -> Future:
    """The grammar as a Future, vLLM's contract for compiles (a failed one fails that request
    alone). As vLLM does for its own grammars, a tree compiles on a worker thread, so a large tree
    does not stall the engine's scheduling loop for every other request; synchronously where vLLM
    compiles synchronously (external_launcher: every rank must see the same ready step)."""
    global _compile_pool
    if getattr(manager, "_use_async_grammar_compilation", False):
        if _compile_pool is None:
            _compile_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logitgate-tree")
        return _compile_pool.submit(_tree_grammar, manager, request)
    done: Future = Future()
    try:
        done.set_result(_tree_grammar(manager, request))
    except Exception as err:  # noqa: BLE001 - any failure fails this request alone
        done.set_exception(err)
    return done


def all_ones_bitmask(vllm_config: Any, rows: int) -> Any:
    """The int32 (rows, ceil(V/32)) all-ones tensor vLLM's grammar backends allocate as a batch
    bitmask, for a manager that has no backend (only tree requests)."""
    import torch

    words = (vllm_config.model_config.get_vocab_size() + 31) // 32
    return torch.full((rows, words), -1, dtype=torch.int32)


def _ensure_bitmask(manager: Any) -> None:
    """vLLM allocates the batch bitmask through its grammar backend, which a server with only tree
    requests never creates: allocate the same tensor here."""
    if manager._grammar_bitmask is None and manager.backend is None:
        config = manager.vllm_config
        manager._grammar_bitmask = all_ones_bitmask(config, config.scheduler_config.max_num_seqs
                                                    * (1 + config.num_speculative_tokens))


def grammar_init_replacement(original: Callable, name: str) -> Callable:
    """StructuredOutputManager.grammar_init: a tree request's grammar compiled by logitgate; every
    other request's by the manager's own backend."""

    def grammar_init(self: Any, request: Any) -> None:
        from .grammar import TreeOutputRequest

        if not isinstance(request.structured_output_request, TreeOutputRequest):
            return original(self, request)
        _ensure_bitmask(self)
        request.structured_output_request.grammar = _grammar_future(self, request)

    return mark_replacement(grammar_init, original, name)


def _rows() -> tuple:
    from ..patches import TREE_PATCHES

    return TREE_PATCHES


def _guard_beam_search() -> list[str]:
    """Install the beam-search rows (`only_if_loaded`) for vLLM's request classes imported since
    the plugin installed the table (the API server imports them before loading plugins; tests import them later)."""
    return patching.install([row for row in _rows() if row.only_if_loaded], {patching.ALWAYS})
