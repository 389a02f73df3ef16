"""Sampling over layouts: one sampler, the logits of a batch in one or more (rows, width) layouts.

A layout holds some rows of the batch as (n, W) float logits plus a map from its columns to token
ids. The dense layout is the identity map over the whole vocabulary; a sparse layout holds only the
tokens a constraint allows (e.g. a tree state's candidates, structured/tree/candidates.py) with
every other column -inf. Sampling a sparse layout is the same draw as sampling the masked full row:
the softmax, temperature, top-k, top-p and min-p of a row see the same finite logits either way
(disallowed tokens are -inf, probability 0, in both), greedy picks the first maximum (columns
follow token order, so ties go to the smallest token id, as the dense argmax breaks them), and
logprobs of the sampled token, its rank and the top-n are the same (entries past a row's allowed
tokens are -inf in both; their ids are unspecified).

`sample_layouts` runs `Sampler` on each layout with the metadata of its rows and maps the sampled
columns (and logprob token ids) back to token ids, in batch order.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..backends.transfer import to_device
from .processors.state import LogitsProcessors
from .sampler import LogprobsTensors, Sampler, SamplerOutput, SamplingMetadata

__all__ = ["Layout", "sample_layouts", "select_rows"]


@dataclass(frozen=True)
class Layout:
    """Rows of a batch laid out for sampling.

    rows: the batch rows, in layout order (host ints; None: every row of the batch, in order);
    logits: float (len(rows), W), masked (columns a row may not emit are -inf);
    token_ids: columns (n, k) -> int64 token ids (n, k); None: the identity (the dense layout).
    """

    rows: Sequence[int] | None
    logits: torch.Tensor
    token_ids: Callable[[torch.Tensor], torch.Tensor] | None = None


def select_rows(metadata: SamplingMetadata, rows: Sequence[int], device: torch.device) -> SamplingMetadata:
    """The metadata of a subset of the batch's rows (in the given order). Per-row tensors are
    indexed on the device; generators follow their rows; prefetched noise is dropped (it was drawn
    for the whole batch's shape)."""
    _check_no_processors(metadata)
    index = to_device(torch.tensor(list(rows), dtype=torch.int64), device)

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, index.to(t.device))

    position = {row: i for i, row in enumerate(rows)}
    return dataclasses.replace(
        metadata,
        temperature=pick(metadata.temperature),
        top_p=pick(metadata.top_p),
        top_k=pick(metadata.top_k),
        min_p=pick(metadata.min_p),
        generators={position[r]: g for r, g in metadata.generators.items() if r in position},
        logitsprocs=LogitsProcessors(),
        noise=None,
    )


def _check_no_processors(metadata: SamplingMetadata) -> None:
    if len(metadata.logitsprocs):
        raise ValueError(
            "logits processors work on whole-vocabulary rows of the batch; apply them to the full logits "
            "and sample densely (or pass min_p through SamplingMetadata.min_p)"
        )


def _pad_columns(logits: torch.Tensor, width: int) -> torch.Tensor:
    """At least `width` columns (extra columns -inf), so that a top-n fits."""
    if logits.shape[1] >= width:
        return logits
    pad = torch.full((logits.shape[0], width - logits.shape[1]), float("-inf"), dtype=logits.dtype, device=logits.device)
    return torch.cat((logits, pad), dim=1)


def sample_layouts(
    sampler: Sampler, layouts: Sequence[Layout], metadata: SamplingMetadata, batch_size: int
) -> SamplerOutput:
    """Sample every row of a batch of `batch_size` rows from its layout: token ids int32 (B, 1)
    and logprobs (token ids mapped), as `sampler(full_masked_logits, metadata)` would return (the
    same distribution; the same tokens for greedy rows). Every row must be in exactly one layout."""
    if len(layouts) == 1 and layouts[0].rows is None:
        only = layouts[0]
        width = metadata.max_num_logprobs + 1 if metadata.max_num_logprobs is not None else 0
        logits = _pad_columns(only.logits, width)
        if only.token_ids is not None:
            _check_no_processors(metadata)
        out = sampler(logits, metadata)
        return out if only.token_ids is None else _mapped(out, only.token_ids)
    device = layouts[0].logits.device if layouts else torch.device("cpu")
    sampled = torch.empty((batch_size, 1), dtype=torch.int32, device=device)
    seen = 0
    parts: list[tuple[torch.Tensor, LogprobsTensors]] = []
    for layout in layouts:
        rows = list(range(batch_size)) if layout.rows is None else list(layout.rows)
        seen += len(rows)
        if not rows:
            continue
        width = metadata.max_num_logprobs + 1 if metadata.max_num_logprobs is not None else 0
        out = sampler(_pad_columns(layout.logits, width), select_rows(metadata, rows, device))
        if layout.token_ids is not None:
            out = _mapped(out, layout.token_ids)
        index = to_device(torch.tensor(rows, dtype=torch.int64), device)
        sampled.index_copy_(0, index, out.sampled_token_ids)
        if out.logprobs_tensors is not None:
            parts.append((index, out.logprobs_tensors))
    if seen != batch_size:
        raise ValueError(f"the layouts hold {seen} rows for a batch of {batch_size}")
    logprobs = None
    if parts:
        n = parts[0][1].logprobs.shape[1]
        ids = torch.empty((batch_size, n), dtype=torch.int32, device=device)
        values = torch.empty((batch_size, n), dtype=torch.float32, device=device)
        ranks = torch.empty(batch_size, dtype=torch.int64, device=device)
        for index, part in parts:
            ids.index_copy_(0, index, part.logprob_token_ids)
            values.index_copy_(0, index, part.logprobs)
            ranks.index_copy_(0, index, part.selected_token_ranks)
        logprobs = LogprobsTensors(ids, values, ranks)
    return SamplerOutput(sampled, logprobs)


def _mapped(out: SamplerOutput, token_ids: Callable[[torch.Tensor], torch.Tensor]) -> SamplerOutput:
    """Columns -> token ids in the sampled tokens and the logprob token ids."""
    sampled = token_ids(out.sampled_token_ids.to(torch.int64)).to(torch.int32)
    lp = out.logprobs_tensors
    if lp is not None:
        lp = LogprobsTensors(token_ids(lp.logprob_token_ids.to(torch.int64)).to(torch.int32), lp.logprobs, lp.selected_token_ranks)
    return SamplerOutput(sampled, lp)
