"""vLLM v1 custom logits processor for tree decode (the V1 model runner's interface).

With logitgate's general plugin active (the default once logitgate is installed), tree requests are
served as vLLM structured outputs (tree/route.py), which also holds under speculative decoding;
this processor then leaves them alone, so a tree is never applied twice. It is the route for
engines where the plugin is excluded (`VLLM_PLUGINS`) or `LOGITGATE_VLLM_OPS` leaves out `tree`.

`TreeDecodeLogitsProcessor` constrains every request whose `SamplingParams.extra_args` names a tree
("tree_decode": an RTP-LLM prefix-dict config; or "token_trie" with "end_token_id") to that tree's
paths; other requests are left alone. Enable it with
`LLM(model, logits_processors=["logitgate.integrations.vllm:TreeDecode"])` (one name for both
model runners; this class is what the V1 runner gets) or `--logits-processors ...`. vLLM refuses
custom logits processors with speculative decoding on the V1 runner (an error, not silence).
Trees are named as in tree/args.py (a dict, a JSON string, or a server tree's name; never a path).

The work is done by `logitgate.sampling.processors.Tree`; this class only speaks vLLM's interface:
it subclasses vLLM's `LogitsProcessor` when vLLM is importable, and logitgate's own otherwise (the
module then still imports and the class works with logitgate's BatchUpdate).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ....checks import is_integer
from ....sampling.processors.interface import BatchUpdate, MoveDirectionality
from ....sampling.processors.interface import LogitsProcessor as _LogitgateLogitsProcessor
from ....sampling.processors.tree import Tree
from . import route as tree_route
from .args import tree_request_for

__all__ = ["FQCN", "VLLM_AVAILABLE", "TreeDecodeLogitsProcessor", "admit_tree_args"]

logger = logging.getLogger(__name__)

try:
    from vllm.v1.sample.logits_processor import LogitsProcessor as _Base

    VLLM_AVAILABLE = True
except ImportError as exc:  # vLLM is optional: fall back to logitgate's identical interface
    logger.debug("vllm is not importable (%s); TreeDecodeLogitsProcessor uses logitgate's interface", exc)
    _Base = _LogitgateLogitsProcessor
    VLLM_AVAILABLE = False


FQCN = "logitgate.integrations.vllm:TreeDecodeLogitsProcessor"


def admit_tree_args(sampling_params: Any) -> None:
    """The processors' front-end check (both runners): the request's tree, if any, admitted
    without knowing the vocabulary; ValueError names the problem."""
    request = tree_request_for(sampling_params)
    if request is not None:
        from ..tree.admission import admit

        admit(request, None, getattr(sampling_params, "eos_token_id", None))


def _vocab_size(vllm_config: Any) -> int:
    if is_integer(vllm_config):
        return int(vllm_config)
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        raise ValueError("vllm_config has no model_config: TreeDecodeLogitsProcessor needs the model's vocabulary size")
    return int(model_config.get_vocab_size())


def _as_logitgate_update(batch_update: Any) -> BatchUpdate | None:
    """vLLM's BatchUpdate as logitgate's: the same tuples, with vLLM's MoveDirectionality members
    mapped by name (the two enums are distinct classes)."""
    if batch_update is None or isinstance(batch_update, BatchUpdate):
        return batch_update
    moved = [(a, b, MoveDirectionality[direction.name]) for a, b, direction in batch_update.moved]
    return BatchUpdate(
        batch_size=batch_update.batch_size,
        removed=batch_update.removed,
        added=batch_update.added,
        moved=moved,
    )


class _VllmTree(Tree):
    """logitgate's Tree with vLLM's request resolution (names, no client paths, the server-wide
    tree), leaving tree requests to the structured-output route where the plugin installed it."""

    def tree_for(self, params: Any) -> Any:
        if tree_route.is_installed():
            return None
        request = tree_request_for(params)
        if request is None:
            return None
        return request.compile(self.vocab_size, self.device, self.eos_token_id)


class TreeDecodeLogitsProcessor(_Base):
    """vLLM's constructor: `(vllm_config, device, is_pin_memory)`; the vocabulary size comes from
    `vllm_config.model_config.get_vocab_size()` (outside vLLM, pass the vocabulary size as an int).
    Not argmax-invariant: greedy requests are constrained too."""

    def __init__(self, vllm_config: Any, device: torch.device | str, is_pin_memory: bool = False) -> None:
        self.tree = _VllmTree(_vocab_size(vllm_config), device, pin_memory=is_pin_memory)

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Called by vLLM's front end for every request (before it reaches a worker): admits the
        tree (tree/admission.py: parsed within the operator's limits, not compiled), so a malformed
        tree is an HTTP 400. Token ids are checked against the vocabulary only in the worker, which
        knows it."""
        admit_tree_args(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Any) -> None:
        self.tree.update_state(_as_logitgate_update(batch_update))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return self.tree.apply(logits)

    def apply_with_spec_decode(self, logits, num_draft_tokens, draft_token_ids=None) -> torch.Tensor:
        """logitgate's layout (each request's draft rows, then its bonus row; see
        `LogitsProcessor.apply_with_spec_decode`); vLLM 0.33 itself never calls this."""
        return self.tree.apply_with_spec_decode(logits, num_draft_tokens, draft_token_ids)
