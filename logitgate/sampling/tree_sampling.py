"""Sampling a tree step: the layouts of a `structured.tree.candidates.TreeStepPlan` run through the
Sampler, or the shortcuts that skip them (an all-greedy batch's argmax over candidates, the backend's
fused draw over candidates), with the same distribution and random numbers as masking the full rows
and sampling them.

The constraint layer (structured/tree/candidates.py) decides the layout of each row (sparse width
groups, dense rows) and owns the gathers; this module samples the plan. It lives in sampling/ so the
layers point one way (sampling -> structured, never back).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..backends import backend_for_tensor
from ..backends.base import NOISE_UNIFORM
from ..backends.sampling_rules import draw_uniforms
from ..structured.tree import TreeDFA
from ..structured.tree.candidates import TreeStepPlan, plan_tree_step
from .ops import check_logits, check_noise, check_top_p_values
from .params import SAMPLING_EPS
from .sampler import SamplerOutput
from .sparse import Layout, sample_layouts, select_rows

__all__ = ["fused_plan", "greedy_plan", "sample_plan", "sample_tree_step", "tree_layouts"]


def _check_plan(plan: TreeStepPlan, logits: torch.Tensor) -> None:
    """The plan fits `logits`: same device as its trees, and every planned row inside the batch
    (the candidate kernels read logits rows unchecked)."""
    for part in (plan.dense, *plan.sparse):
        if part is not None:
            part.tree.check_device(logits, "logits")
    if logits.dim() != 2 or plan.batch_size > logits.shape[0]:
        raise ValueError(
            f"the plan covers batch rows up to {plan.batch_size - 1} but logits have shape {tuple(logits.shape)}"
        )


def tree_layouts(plan: TreeStepPlan, logits: torch.Tensor) -> list:
    """The sampling layouts of a plan over `logits` (B, V): dense rows masked in place (and copied
    out when they are not the whole batch), sparse groups gathered. Returns sampling.sparse.Layout
    objects for `sample_layouts`."""
    _check_plan(plan, logits)
    everything = list(range(logits.shape[0]))
    layouts = []
    if plan.dense is not None:
        plan.dense.mask(logits)
        if plan.dense.row_list == everything:
            layouts.append(Layout(None, logits))
        else:
            layouts.append(Layout(plan.dense.row_list, logits.index_select(0, plan.dense.rows.to(logits.device))))
    for group in plan.sparse:
        rows = None if group.row_list == everything else group.row_list
        layouts.append(Layout(rows, group.gather(logits), group.token_ids))
    return layouts


def sample_tree_step(
    sampler,
    logits: torch.Tensor,
    tree: TreeDFA,
    states: torch.Tensor,
    metadata,
    *,
    host_states: Sequence[int] | np.ndarray | None = None,
    sparse_max_fraction: float | None = None,
):
    """One constrained sampling step: row i of `logits` (B, V) under tree state states[i], sampled
    with `sampler` (a Sampler) and `metadata` (SamplingMetadata) over the layouts `plan_tree_step`
    picks. Returns the SamplerOutput (token ids, logprobs), distributed as sampling the masked
    full rows. Dense rows of `logits` are masked in place."""
    plan = plan_tree_step(tree, states, logits.shape[-1], host_states=host_states, sparse_max_fraction=sparse_max_fraction)
    return sample_plan(sampler, plan, logits, metadata)


def sample_plan(sampler, plan: TreeStepPlan, logits: torch.Tensor, metadata):
    """Sample every row of `logits` (B, V) over the layouts of `plan` (sampling.sparse.sample_layouts).
    An all-greedy batch without logprobs or logits processors takes the sampler's greedy path
    directly: each sparse group's argmax over its gathered candidates, the dense rows' argmax over
    their masked rows (the same tokens, without the layouts' per-call overhead). Random rows
    without logprobs, logits processors or min-p take `fused_plan` where the backend fuses the
    draw over candidates (CPU), the same draw with the same random numbers."""
    greedy_only = metadata.all_greedy and metadata.max_num_logprobs is None and not len(metadata.logitsprocs)
    if greedy_only:
        return SamplerOutput(greedy_plan(sampler, plan, logits).to(torch.int32).unsqueeze(1), None)
    if plan.sparse and _fused_draws(sampler, plan, logits, metadata):
        return SamplerOutput(fused_plan(sampler, plan, logits, metadata).to(torch.int32).unsqueeze(1), None)
    return sample_layouts(sampler, tree_layouts(plan, logits), metadata, logits.shape[0])


def _fused_draws(sampler, plan: TreeStepPlan, logits: torch.Tensor, metadata) -> bool:
    """Whether the sparse groups can be drawn with Backend.sample_candidates: the backend fuses it,
    draws with one uniform per row (the noise the sampler's random_sample consumes there), and the
    step asks for nothing the fused draw leaves out (logprobs, logits processors, min-p: those take
    the layouts and the Sampler)."""
    backend = backend_for_tensor(logits, sampler.backend)
    tree_backend = plan.sparse[0].tree.backend
    return (
        backend.fused_candidate_sampling and tree_backend.fused_candidate_sampling
        and backend.sampling_noise_kind == NOISE_UNIFORM and tree_backend.sampling_noise_kind == NOISE_UNIFORM
        and metadata.max_num_logprobs is None and not len(metadata.logitsprocs) and metadata.min_p is None
    )


def fused_plan(sampler, plan: TreeStepPlan, logits: torch.Tensor, metadata) -> torch.Tensor:
    """int64 (B,): every row of `logits` (B, V) sampled under `plan` as sample_layouts would (the
    same distribution, and the same random numbers: each layout's rows draw their uniforms from
    their own generators, or the default one, in layout order, dense rows first), with each sparse
    group drawn by Backend.sample_candidates instead of gathered and run through the Sampler's ops.
    Dense rows (masked in place) take the Sampler."""
    check_logits(logits)
    _check_plan(plan, logits)
    batch = logits.shape[0]
    temperature = metadata.temperature
    if temperature is None or temperature.shape != (batch,):
        raise ValueError(f"metadata.temperature must have shape ({batch},) for a batch with random rows")
    everything = list(range(batch))
    parts = ([plan.dense] if plan.dense is not None else []) + list(plan.sparse)
    if sum(len(part.row_list) for part in parts) != batch:
        raise ValueError(f"the plan holds {sum(len(p.row_list) for p in parts)} rows for a batch of {batch}")
    check_top_p_values(metadata.top_p, "top_p")
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if plan.dense is not None:
        (layout,) = tree_layouts(TreeStepPlan(plan.batch_size, plan.vocab_size, plan.dense, ()), logits)
        rows = plan.dense.row_list
        dense_meta = metadata if layout.rows is None else select_rows(metadata, rows, logits.device)
        picked = sampler(layout.logits, dense_meta).sampled_token_ids.squeeze(1).to(torch.int64)
        if layout.rows is None:
            return picked
        tokens.index_copy_(0, plan.dense.rows.to(logits.device), picked)
    greedy = None if metadata.all_random else temperature < SAMPLING_EPS
    for group in plan.sparse:
        if group.row_list == everything:
            # One layout holds the batch: the sampler would draw it with the metadata as given,
            # prefetched uniforms included.
            uniform = _take_uniform_noise(metadata.noise, logits, backend_for_tensor(logits, sampler.backend))
            if uniform is None:
                uniform = draw_uniforms(batch, metadata.generators, logits.device)
            return group.sample(logits, temperature, greedy, metadata.top_k, metadata.top_p, uniform)
        # The group's rows as sample_layouts hands them to the Sampler: their per-row values and
        # their generators at their positions in the group.
        part = select_rows(metadata, group.row_list, logits.device)
        uniform = draw_uniforms(len(group.row_list), part.generators, logits.device)
        part_greedy = None if greedy is None else part.temperature < SAMPLING_EPS
        drawn = group.sample(logits, part.temperature, part_greedy, part.top_k, part.top_p, uniform)
        tokens.index_copy_(0, group.rows.to(logits.device), drawn)
    return tokens


def _take_uniform_noise(noise, logits: torch.Tensor, backend) -> torch.Tensor | None:
    """The prefetched uniforms of a whole-batch draw (checked as random_sample checks them, then
    marked used), or None when none were drawn. `backend` draws with uniform noise (_fused_draws)."""
    if noise is None:
        return None
    check_noise(noise, logits, backend)
    noise.consumed = True
    return noise.values


def greedy_plan(sampler, plan: TreeStepPlan, logits: torch.Tensor) -> torch.Tensor:
    """int64 (B,): the greedy token of every row of `logits` under `plan` (dense rows are masked
    in place), as `sampler` picks it from the masked full rows."""
    check_logits(logits)
    _check_plan(plan, logits)
    batch = logits.shape[0]
    everything = list(range(batch))
    parts = ([plan.dense] if plan.dense is not None else []) + list(plan.sparse)
    if sum(len(part.row_list) for part in parts) != batch:
        raise ValueError(f"the plan holds {sum(len(p.row_list) for p in parts)} rows for a batch of {batch}")
    if len(parts) == 1 and parts[0].row_list == everything and plan.dense is None:
        return parts[0].argmax(logits)
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if plan.dense is not None:
        plan.dense.mask(logits)
        rows = plan.dense.rows.to(logits.device)
        picked = logits if plan.dense.row_list == everything else logits.index_select(0, rows)
        tokens.index_copy_(0, rows, backend_for_tensor(logits, sampler.backend).argmax(picked.to(torch.float32)))
    for group in plan.sparse:
        tokens.index_copy_(0, group.rows.to(logits.device), group.argmax(logits))
    return tokens
