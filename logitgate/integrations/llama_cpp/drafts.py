"""Prompt-lookup (or any) speculative drafts under a constraint.

llama-cpp-python verifies a draft model's tokens by sampling each drafted position in turn
(`Llama(draft_model=...)`), calling the logits processors once per position with the drafts
already in `input_ids`. `TreeDrafts` wraps the draft model: it drops the drafts the constraint
would refuse (they could never be accepted) before they are evaluated, and tells the active
processor which position each following call samples. Outputs are the ones decoding without
drafts gives: every emitted token is still one sampler call over the constrained logits."""
from __future__ import annotations

from typing import Any

import numpy as np

try:
    from llama_cpp.llama_speculative import LlamaDraftModel as _DraftBase
except ImportError:  # pragma: no cover - the module is importable without llama-cpp-python
    _DraftBase = object


class TreeDrafts(_DraftBase):  # type: ignore[misc]
    """`Llama(draft_model=TreeDrafts(LlamaPromptLookupDecoding(num_pred_tokens=10)))`."""

    def __init__(self, draft_model: Any) -> None:
        if not callable(draft_model):
            raise ValueError(f"draft_model must be a llama-cpp-python draft model, got {type(draft_model).__name__}")
        self.draft_model = draft_model
        self.active: Any = None  # the processor of the generation in progress (set by it)
        self.proposed = 0
        self.dropped = 0

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        drafts = np.asarray(self.draft_model(input_ids, **kwargs), dtype=np.intc)
        processor = self.active
        if processor is not None:
            keep = processor.valid_drafts(input_ids, drafts.tolist())
            self.proposed += len(drafts)
            self.dropped += len(drafts) - keep
            drafts = drafts[:keep]
            processor.expect_drafts(len(input_ids), len(drafts))
        return drafts


def check_draft_model(llm: Any) -> None:
    """A constraint needs to know which position each call samples: a draft model must be wrapped."""
    draft = getattr(llm, "draft_model", None)
    if draft is not None and not isinstance(draft, TreeDrafts):
        raise ValueError(
            f"this Llama has draft_model={type(draft).__name__}; constrained generation needs it wrapped "
            "as draft_model=TreeDrafts(...) (logitgate.integrations.llama_cpp) so that drafts are checked "
            "against the constraint and verified at the right positions"
        )


def register(processor: Any) -> None:
    """Make `processor` the one a TreeDrafts of its model reports to."""
    draft = getattr(processor.info.llm, "draft_model", None)
    if isinstance(draft, TreeDrafts) and draft.active is not processor:
        draft.active = processor
