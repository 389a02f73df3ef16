"""Tree decode as a Model Runner V2 custom logits processor, and `TreeDecode`, the one name both
of vLLM's model runners load.

Model Runner V2 (`vllm.v1.worker.gpu.sample.logits_processor.interface`) has no BatchUpdate:
`add_request(req_idx, params)` (re)initialises a request slot (slots are recycled) and
`apply(logits, ctx)` gets the step's layout. A request owns one logits row per draft token under
speculative decoding: row r belongs to slot `ctx.expanded_idx_mapping[r]`, is the
`ctx.expanded_local_pos[r]`-th row of its request, and was fed token `ctx.input_ids[r]` at
position `ctx.pos[r]`. So the tokens before row r's prediction are the committed ones in
`req_states.all_token_ids[slot, prompt_len:pos0]` (pos0 = the position of the request's first
row) followed by the `input_ids` of the request's rows up to r (the last sampled token, then the
drafts). Each slot keeps its walk over committed tokens and extends it incrementally; drafts are
walked per step from there (a draft the tree rejects leads to the error state, whose only token is
the end token; vLLM's rejection sampler rejects that draft, so its later rows are never sampled).

As with the V1 class, requests are left to the structured-output route where the plugin installed
it. Reading the step's layout costs one device-to-host copy per step, made only when a request in
the batch has a tree.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ....sampling.processors.tree import Tree
from ....structured.tree.cursor import TreeCursor
from . import route as tree_route
from .args import tree_request_for
from .logits_processor import TreeDecodeLogitsProcessor, admit_tree_args
from .logits_processor import _Base as _V1Base

logger = logging.getLogger(__name__)

try:
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as _V2Base
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcRequestState

    VLLM_V2_AVAILABLE = True
except ImportError as exc:  # vLLM without Model Runner V2's interface: the class still imports
    logger.debug("vLLM's Model Runner V2 logits-processor interface is not importable (%s)", exc)
    _V2Base, LogitsProcRequestState = object, None
    VLLM_V2_AVAILABLE = False

__all__ = ["VLLM_V2_AVAILABLE", "TreeDecode", "TreeDecodeLogitsProcessorV2"]


class TreeDecodeLogitsProcessorV2(_V2Base):
    """Model Runner V2's constructor: `(vllm_config, req_states: LogitsProcRequestState)`; the
    vocabulary size and device come from `req_states`."""

    def __init__(self, vllm_config: Any, req_states: Any) -> None:
        self.req_states = req_states
        self.vocab_size = int(req_states.vocab_size)
        self.masker = Tree(self.vocab_size, req_states.device)  # trees' device and the batched mask
        self._slots: dict[int, TreeCursor] = {}  # each slot's walk over its committed output tokens

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        admit_tree_args(sampling_params)

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        self._slots.pop(req_idx, None)  # the slot may hold a finished request's walk
        if tree_route.is_installed():
            return False
        request = tree_request_for(sampling_params)
        if request is None:
            return False
        tree = request.compile(self.vocab_size, self.masker.device, getattr(sampling_params, "eos_token_id", None))
        self._slots[req_idx] = TreeCursor(tree)
        return True

    def _committed(self, slot: int, start: int, end: int) -> TreeCursor:
        """The slot's walk after its committed output tokens at positions [start, end) (a shorter
        output than before: the request was preempted or rolled back, and is replayed)."""
        walk = self._slots[slot]
        tokens = self.req_states.all_token_ids.gpu
        walk.catch_up(end - start, lambda a, b: tokens[slot, start + a : start + b].tolist())
        return walk

    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        if not self._slots or not any(int(slot) in self._slots for slot in ctx.idx_mapping_np):
            return logits
        slots = ctx.expanded_idx_mapping.tolist()
        local = ctx.expanded_local_pos.tolist()
        pos = ctx.pos.tolist()
        input_ids = ctx.input_ids.tolist()
        prompt_len = self.req_states.prompt_len.np
        entries = []
        for row, slot in enumerate(slots):
            if slot not in self._slots:
                continue
            first_row = row - local[row]
            start, pos0 = int(prompt_len[slot]), pos[row] - local[row]
            walk = self._committed(slot, start, max(start, pos0))
            # Output tokens fed this step, up to this row's own input: positions max(start, pos0)..pos[row].
            fed = input_ids[first_row + max(0, start - pos0) : row + 1] if pos[row] >= start else []
            entries.append((row, walk.tree, walk.walk_states(fed, self.vocab_size)[-1]))
        return self.masker.mask_rows(logits, entries)




class TreeDecode(_V1Base, *(() if _V2Base is object else (_V2Base,))):  # type: ignore[misc]
    """One name for both model runners: `logits_processors=["logitgate.integrations.vllm:TreeDecode"]`.
    It is a subclass of both runners' LogitsProcessor (each loader checks that), and constructing
    it returns the class for the runner that constructs it: `(vllm_config, req_states)` from Model
    Runner V2 gives a TreeDecodeLogitsProcessorV2, `(vllm_config, device, is_pin_memory)` from the
    V1 runner a TreeDecodeLogitsProcessor."""

    def __new__(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        state = args[0] if args else kwargs.get("req_states")
        if LogitsProcRequestState is not None and isinstance(state, LogitsProcRequestState):
            return TreeDecodeLogitsProcessorV2(vllm_config, state)
        return TreeDecodeLogitsProcessor(vllm_config, *args, **kwargs)

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        admit_tree_args(sampling_params)

    def apply(self, logits: torch.Tensor, *args: Any) -> torch.Tensor:  # never reached: __new__ returns another class
        raise TypeError("TreeDecode is constructed as TreeDecodeLogitsProcessor or TreeDecodeLogitsProcessorV2")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Any) -> None:
        raise TypeError("TreeDecode is constructed as TreeDecodeLogitsProcessor or TreeDecodeLogitsProcessorV2")
