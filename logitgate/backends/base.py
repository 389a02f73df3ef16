"""The Backend interface: the one place that knows which device logitgate runs on.

`sampling/` and `structured/` call `backend.<op>(...)` on already-validated tensors; each backend
decides which kernel runs and reports that decision through `capabilities` and `kernels()`.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any

import torch

from . import reference


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, so callers never test device types themselves."""

    native_bitmask: bool  # the bitmask is applied on the device (no host round trip)
    torch_compile: bool  # torch.compile produces kernels for this device
    triton: bool  # Triton kernels run on this device (triton / triton-ascend / interpreter)
    side_streams: bool  # work can be queued on a second stream and joined with an event
    vector_cores: int | None = None  # Ascend vector cores (launch grid size); None elsewhere

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Backend(ABC):
    """A device and the kernels logitgate uses on it. Obtain one with `get_backend()`."""

    name: str = "abstract"

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abstractmethod
    def kernels(self) -> dict[str, str]:
        """Operation name -> the kernel this backend will run for it (shown by `logitgate doctor`)."""

    # ---- kernels (inputs are validated by the public functions that call these) ----

    @abstractmethod
    def apply_token_bitmask(
        self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None, vocab_size: int
    ) -> None:
        """In place: logits[r, t] = -inf where bit t of bitmask[r] is 0, for t < vocab_size and each
        selected row r (`rows` selects rows of both tensors; None = all rows)."""

    def fill_tree_bitmask(
        self,
        bitmask: torch.Tensor,
        states: torch.Tensor,
        allow_start: torch.Tensor,
        allow_tok: torch.Tensor,
        fill_width: torch.Tensor,
        max_width: int,
        dense_rows: torch.Tensor | None,
        dense_slot: torch.Tensor | None,
    ) -> None:
        """bitmask[r] := the allowed tokens of tree state states[r] (see
        reference.fill_tree_bitmask_reference); on the device, no host sync."""
        reference.fill_tree_bitmask_reference(bitmask, states, allow_start, allow_tok, fill_width, max_width, dense_rows, dense_slot)

    # ---- speculative decoding: rejection sampling (layout and semantics in reference.py) ----

    # The noise `rejection_recover` consumes: "uniform" = one float64 per request (inverse CDF, cheap
    # where the vocabulary is walked serially), "exponential" = float32 (B, V) Exp(1) draws for the
    # race argmax(w / q), which parallelises without a sync and can be drawn on a side stream.
    recovery_noise: str = "exponential"

    def rejection_greedy_accept(
        self,
        cu_num_draft_tokens: torch.Tensor,
        draft_token_ids: torch.Tensor,
        target_logits: torch.Tensor,
        active: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted int32 (B,), correction int32 (B,)): leading drafts equal to the target argmax
        and the argmax at the first mismatch."""
        return reference.rejection_greedy_accept_reference(cu_num_draft_tokens, draft_token_ids, target_logits, active)

    def rejection_random_accept(
        self,
        cu_num_draft_tokens: torch.Tensor,
        draft_token_ids: torch.Tensor,
        target_logits: torch.Tensor,
        temperature: torch.Tensor | None,
        draft_probs: torch.Tensor | None,
        uniform: torch.Tensor,
        active: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted int32 (B,), row_lse float32 (B,)): leading drafts with target_p / draft_p >= u
        and the logsumexp of the first rejected row."""
        return reference.rejection_random_accept_reference(
            cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, uniform, active
        )

    def rejection_recover(
        self,
        cu_num_draft_tokens: torch.Tensor,
        draft_token_ids: torch.Tensor,
        target_logits: torch.Tensor,
        temperature: torch.Tensor | None,
        draft_probs: torch.Tensor | None,
        accepted: torch.Tensor,
        row_lse: torch.Tensor,
        noise: torch.Tensor,
        active: torch.Tensor | None,
    ) -> torch.Tensor:
        """int32 (B,): the recovered token at each request's first rejected row, drawn with `noise`
        of kind `recovery_noise`."""
        needed, weights = reference.recovery_weights_reference(
            cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, accepted, row_lse, active
        )
        if self.recovery_noise == "uniform":
            return reference.rejection_recover_inverse_cdf_reference(needed, weights, noise)
        return reference.rejection_recover_exponential_reference(needed, weights, noise)

    # ---- streams: where work that must not block the decode step is queued ----

    def side_stream(self) -> contextlib.AbstractContextManager:
        """Context in which queued work runs off the main stream (a no-op where there is none)."""
        return contextlib.nullcontext()

    def record_event(self) -> Any:
        """An event marking the work queued so far on the current stream (None where synchronous)."""
        return None

    def wait_event(self, event: Any) -> None:
        """Make the current stream wait for `event` without blocking the host."""

    # ---- misc ----

    def synchronize(self) -> None:
        """Block the host until queued work finished (benchmarks only; never inside a decode step)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} on {self.device}>"
