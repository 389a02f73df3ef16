"""Grammar bitmasks under speculative decoding: moving the manager's rows (request order, 1 + drafts
rows each) to the logits' batch order, and dropping -1 draft padding."""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from ..backends import Backend
from ..backends.transfer import to_device
from ..checks import is_integer, short_repr
from .bitmask import apply_token_bitmask_inplace

logger = logging.getLogger(__name__)

__all__ = ["apply_grammar_bitmask", "grammar_bitmask_rows", "strip_speculative_padding"]

SpecCounts = Mapping[str, int | Sequence[int]] | None


def _count(spec_token_counts: SpecCounts, request_id: str) -> int:
    if spec_token_counts is None:
        return 0
    value = spec_token_counts.get(request_id, 0)
    count = value if is_integer(value) else len(value)
    if count < 0:
        raise ValueError(f"request {request_id!r} has a negative draft count {count}")
    return count


def _unique(ids: Sequence[str], what: str) -> None:
    seen: set[str] = set()
    for r in ids:
        if r in seen:
            raise ValueError(f"{what} lists request {r!r} twice")
        seen.add(r)


def grammar_bitmask_rows(
    structured_request_ids: Sequence[str], batch_request_ids: Sequence[str], spec_token_counts: SpecCounts = None
) -> tuple[list[int], list[int], int, int]:
    """Where each manager row goes: (logit rows, manager rows, logit row count, manager row count).

    A request at batch position b owns logit rows b + (drafts of the requests before it) and the
    1 + drafts rows after that; in the manager's bitmask its rows follow those of the structured
    requests listed before it. Structured requests missing from the batch are skipped (as vLLM).
    """
    _unique(structured_request_ids, "structured_request_ids")
    _unique(batch_request_ids, "batch_request_ids")
    logit_start: dict[str, int] = {}
    offset = 0
    for request_id in batch_request_ids:
        logit_start[request_id] = offset
        offset += 1 + _count(spec_token_counts, request_id)
    logit_rows, manager_rows, manager_row = [], [], 0
    for request_id in structured_request_ids:
        n = 1 + _count(spec_token_counts, request_id)
        start = logit_start.get(request_id)
        if start is None:
            logger.debug("structured request %r is not in this batch; its bitmask rows are skipped", request_id)
        else:
            logit_rows.extend(range(start, start + n))
            manager_rows.extend(range(manager_row, manager_row + n))
        manager_row += n
    return logit_rows, manager_rows, offset, manager_row


def apply_grammar_bitmask(
    logits: torch.Tensor,
    grammar_bitmask: torch.Tensor,
    structured_request_ids: Sequence[str],
    batch_request_ids: Sequence[str],
    spec_token_counts: SpecCounts = None,
    *,
    vocab_size: int | None = None,
    backend: str | torch.device | Backend | None = None,
) -> None:
    """Mask `logits` in place with the manager's bitmask.

    logits: (sum over the batch of 1 + drafts, V) in `batch_request_ids` order (the model runner's).
    grammar_bitmask: what `StructuredOutputManager.grammar_bitmask(structured_request_ids, spec)`
    returned (host or device int32). spec_token_counts: request id -> draft count or draft list
    (vLLM's scheduled_spec_decode_tokens); missing ids have no drafts. Rows of unconstrained
    requests are not touched. The row layout is computed on the host from the ids; the bitmask is
    reordered on its own device, copied to the logits' device without blocking, and applied by the
    device backend — no device-to-host synchronisation.
    """
    if not isinstance(grammar_bitmask, torch.Tensor) or grammar_bitmask.dim() != 2:
        raise ValueError("grammar_bitmask must be a 2-D int32 tensor from StructuredOutputManager.grammar_bitmask")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("logits must be a 2-D tensor (rows, vocab)")
    logit_rows, manager_rows, num_logit_rows, num_manager_rows = grammar_bitmask_rows(
        structured_request_ids, batch_request_ids, spec_token_counts
    )
    if logits.shape[0] != num_logit_rows:
        raise ValueError(
            f"logits have {logits.shape[0]} rows but the batch needs {num_logit_rows} (1 + drafts per request)"
        )
    if grammar_bitmask.shape[0] != num_manager_rows:
        raise ValueError(
            f"grammar_bitmask has {grammar_bitmask.shape[0]} rows but structured_request_ids with their drafts "
            f"need {num_manager_rows}"
        )
    if not logit_rows:
        return
    if logit_rows == manager_rows and len(logit_rows) == num_logit_rows == num_manager_rows:
        ordered, indices = grammar_bitmask, None  # already in batch order and covering every row
    else:
        source_device = grammar_bitmask.device
        ordered = torch.full((num_logit_rows, grammar_bitmask.shape[1]), -1, dtype=grammar_bitmask.dtype, device=source_device)
        dst = to_device(torch.tensor(logit_rows, dtype=torch.int64), source_device)
        src = to_device(torch.tensor(manager_rows, dtype=torch.int64), source_device)
        ordered[dst] = grammar_bitmask[src]
        indices = logit_rows  # a host list: the apply never reads indices back from the device
    ordered = to_device(ordered, logits.device)
    apply_token_bitmask_inplace(logits, ordered, indices=indices, vocab_size=vocab_size, backend=backend)


def _not_an_id(value: object) -> int:
    raise ValueError(f"draft token {short_repr(value)} is not an integer token id")


def strip_speculative_padding(
    spec_tokens: Mapping[str, Sequence[int]] | Sequence[Sequence[int]],
) -> dict[str, list[int]] | list[list[int]]:
    """Drop each request's drafts from its first -1 on (the padding `validate_draft_tokens` and
    async schedulers leave), so only real drafts are scheduled and verified."""

    def strip(tokens: Sequence[int]) -> list[int]:
        ids = [int(t) if is_integer(t) else _not_an_id(t) for t in tokens]
        return ids[: ids.index(-1)] if -1 in ids else ids

    if isinstance(spec_tokens, Mapping):
        return {request_id: strip(tokens) for request_id, tokens in spec_tokens.items()}
    return [strip(tokens) for tokens in spec_tokens]
