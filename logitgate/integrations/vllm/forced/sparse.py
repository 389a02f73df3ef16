"""Verification at the cost of the tokens the grammar allows: a forced draft's logits row is
computed only over the tokens its mask row allows (issue 37 c).

At a forced position the grammar's mask allows a handful of tokens (the tokenizations of the rest
of the forced string: `"`, `"na`, `"name`...) out of the vocabulary, and every other logit is set
to -inf by the mask before anything reads it. vLLM computes the LM head over the whole vocabulary
for every draft position; on a small model that head is most of the pass. Here:

1. `_prepare_inputs` (worker.py) asks vLLM's forward for the logits of each request's last
   position only (the bonus row: the grammar may be free there) and records a `Plan`: which
   logits rows are draft rows and which hidden states they come from.
2. After the forward (`expand`, from the execute_model replacement) the logits become the full
   (draft rows + bonus rows, vocabulary) tensor vLLM expects, the draft rows -inf.
3. When the scheduler's bitmask reaches the runner (`complete`, from the apply_grammar_bitmask
   replacement), each draft row gets the logits of the tokens its mask row allows: one dot
   product per allowed token, scaled and soft-capped as the model's LogitsProcessor does. A row
   whose mask allows more than MAX_ALLOWED tokens, or that has no mask row, is computed whole
   with the model's own compute_logits. Then vLLM's mask is applied as before.

The logits vLLM's sampler and rejection path read are therefore the masked logits they would
have read (up to the rounding of a dot product against a GEMM row): the output distribution is
unchanged. Where the head is not a plain matrix (quantized, tensor-parallel, a bias, a model whose
compute_logits does more than its LogitsProcessor), the first sparse row is checked against the
model's own compute_logits and, on a mismatch, this runner computes draft rows whole from then on
(logged once). `LOGITGATE_VLLM_FORCED_SPARSE=0` turns it off (the benchmarks' dense baseline).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .... import envs as _envs
from .. import metrics

__all__ = ["MAX_ALLOWED", "SPARSE_ENV", "Plan", "complete", "enabled", "expand", "plan_for"]

logger = logging.getLogger("logitgate")

SPARSE_ENV = "LOGITGATE_VLLM_FORCED_SPARSE"
# Past this many allowed tokens a row is one GEMM row of the head, cheaper than gathering the
# weight rows of its tokens (a forced position allows 1-8 here; a free one ~100k).
MAX_ALLOWED = 2048
_CHECK_RTOL = 1e-3

_checked: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()  # model -> sparse head agrees


def enabled(value: str | None = None) -> bool:
    """Whether draft rows are computed sparsely (default on); ValueError naming the variable for
    anything but 0 / 1."""
    raw = _envs.read(SPARSE_ENV) if value is None else value
    if raw is None or raw.strip() in ("", "1"):
        return True
    if raw.strip() == "0":
        return False
    raise ValueError(f"{SPARSE_ENV}={raw!r}: expected 1 (draft rows over their allowed tokens) or 0 (whole rows)")


@dataclass
class _Head:
    """The model's LM head as a matrix and the LogitsProcessor's elementwise tail."""

    weight: torch.Tensor  # (padded vocabulary, hidden)
    scale: float
    soft_cap: float | None


def _head_of(model: Any) -> _Head | None:
    """The plain head of `model` (vLLM's `lm_head` / `logits_processor` attributes), None where
    there is none to read."""
    lm_head = getattr(model, "lm_head", None)
    processor = getattr(model, "logits_processor", None)
    weight = getattr(lm_head, "weight", None)
    if processor is None or not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.is_meta:
        return None
    if getattr(processor, "logits_as_input", False) or getattr(lm_head, "tp_size", 1) != 1:
        return None
    return _Head(weight, float(getattr(processor, "scale", 1.0)), getattr(processor, "soft_cap", None))


def plan_for(runner: Any) -> bool:
    """Whether this runner's draft rows can be computed sparsely: on, a plain head whose first
    check has not failed, and the ordinary single-rank path of vLLM's execute_model."""
    if not enabled() or runner.speculative_config is not None or getattr(runner, "is_pooling_model", False):
        return False
    if getattr(runner, "broadcast_pp_output", False) or getattr(runner.cache_config, "kv_sharing_fast_prefill", False):
        return False
    model = getattr(runner, "model", None)
    return model is not None and _checked.get(model, True) and _head_of(model) is not None


@dataclass
class Plan:
    """One batch's sparse verification: the full logits tensor's draft rows and their hidden states."""

    model: Any
    draft_rows: np.ndarray  # logits rows of the draft positions (vLLM's target_logits_indices)
    bonus_rows: np.ndarray  # logits rows computed by the forward (vLLM's bonus_logits_indices)
    hidden: torch.Tensor | None = None  # (len(draft_rows), hidden): the draft positions' hidden states
    logits: torch.Tensor | None = None
    done: bool = field(default=False)


_pending: dict[int, Plan] = {}  # id(full logits) -> its plan (which holds the tensor), until computed
_MAX_PENDING = 8  # one batch in flight per runner, a runner or two per process


@torch.inference_mode()
def expand(plan: Plan, bonus_logits: torch.Tensor, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The full logits tensor of the batch: the forward's rows at the bonus rows, the draft rows
    -inf until `complete`; `positions` are the token positions of all logits rows."""
    rows = len(plan.draft_rows) + len(plan.bonus_rows)
    full = torch.full((rows, bonus_logits.shape[1]), float("-inf"), dtype=bonus_logits.dtype, device=bonus_logits.device)
    full[torch.from_numpy(plan.bonus_rows).to(full.device)] = bonus_logits
    plan.hidden = hidden_states[positions[torch.from_numpy(plan.draft_rows).to(positions.device)]]
    plan.logits = full
    while len(_pending) >= _MAX_PENDING:  # entries of steps that failed before their masks came
        del _pending[next(iter(_pending))]
    _pending[id(full)] = plan
    return full


def _mask_rows_of(plan: Plan, scheduler_output: Any, grammar_output: Any, input_batch: Any) -> np.ndarray:
    """For each draft row, its row in the scheduler's bitmask (-1: none), in the order vLLM's
    apply_grammar_bitmask lays the bitmask against the logits rows."""
    spec = scheduler_output.scheduled_spec_decode_tokens
    first_row: dict[str, int] = {}
    offset = 0
    for batch_index, req_id in enumerate(input_batch.req_ids):
        first_row[req_id] = batch_index + offset
        offset += len(spec.get(req_id, ()))
    by_logits_row = {}
    mask_index = 0
    for req_id in grammar_output.structured_output_request_ids:
        count = 1 + len(spec.get(req_id, ()))
        start = first_row.get(req_id)
        if start is not None:
            for i in range(count):
                by_logits_row[start + i] = mask_index + i
        mask_index += count
    return np.array([by_logits_row.get(int(row), -1) for row in plan.draft_rows], dtype=np.int64)


def _allowed(bitmask: np.ndarray, mask_rows: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sparse: which draft rows are computed over their allowed tokens, their (row, token) pairs
    as two arrays). A row without a mask row or allowing more than MAX_ALLOWED tokens is not sparse."""
    sparse = mask_rows >= 0
    words = np.zeros((len(mask_rows), bitmask.shape[1]), dtype=np.int32)
    words[sparse] = bitmask[mask_rows[sparse]]
    sparse &= np.count_nonzero(words, axis=1) <= MAX_ALLOWED
    words[~sparse] = 0
    row_of_word, word = np.nonzero(words)
    bits = (words[row_of_word, word][:, None] >> np.arange(32, dtype=np.int32)) & 1
    pair, bit = np.nonzero(bits)
    rows = row_of_word[pair]
    tokens = word[pair].astype(np.int64) * 32 + bit
    inside = tokens < vocab
    rows, tokens = rows[inside], tokens[inside]
    counts = np.bincount(rows, minlength=len(mask_rows))
    wide = sparse & (counts > MAX_ALLOWED)
    if wide.any():
        sparse &= ~wide
        keep = sparse[rows]
        rows, tokens = rows[keep], tokens[keep]
    return sparse, rows, tokens


def _sparse_logits(head: _Head, hidden: torch.Tensor, rows: np.ndarray, tokens: np.ndarray) -> torch.Tensor:
    """The head's logits of (draft row, token) pairs: one dot product each, accumulated in float32
    as a GEMM does, then the LogitsProcessor's soft cap and scale."""
    device = hidden.device
    rows_t = torch.from_numpy(rows).to(device)
    tokens_t = torch.from_numpy(tokens).to(device)
    values = (hidden[rows_t].float() * head.weight[tokens_t].float()).sum(-1)
    if head.soft_cap is not None:
        values = torch.tanh(values / head.soft_cap) * head.soft_cap
    if head.scale != 1.0:
        values = values * head.scale
    return values


def _dense(plan: Plan, which: np.ndarray) -> None:
    """Draft rows `which` (indices into plan.draft_rows) computed whole by the model."""
    if len(which) == 0:
        return
    index = torch.from_numpy(which).to(plan.hidden.device)
    rows = torch.from_numpy(plan.draft_rows[which]).to(plan.logits.device)
    plan.logits[rows] = plan.model.compute_logits(plan.hidden[index]).to(plan.logits.dtype)
    metrics.add("forced_rows_whole", len(which))
    metrics.add("forced_logits_computed", len(which) * plan.logits.shape[1])


def _agrees(plan: Plan, head: _Head, row: int, tokens: np.ndarray, values: torch.Tensor) -> bool:
    """Whether the model's own compute_logits gives one draft row's sparse values (once per model)."""
    reference = plan.model.compute_logits(plan.hidden[row : row + 1])[0, torch.from_numpy(tokens)].float()
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    ok = bool(torch.allclose(values.float().cpu(), reference.cpu(), rtol=_CHECK_RTOL, atol=_CHECK_RTOL * max(scale, 1.0)))
    _checked[plan.model] = ok
    if not ok:
        logger.warning("logitgate forced drafts: this model's logits are not its head's matrix product (a bias, a "
                       "quantized or sharded head); draft rows are computed whole from now on")
    return ok


@torch.inference_mode()
def complete(logits: torch.Tensor, scheduler_output: Any = None, grammar_output: Any = None, input_batch: Any = None) -> None:
    """Compute the draft rows of `logits` if it is a planned batch's (else nothing): over their
    allowed tokens where the grammar output gives a narrow mask row, whole otherwise."""
    plan = _pending.pop(id(logits), None)
    if plan is None or plan.logits is not logits or plan.done:
        return
    plan.done = True
    every = np.arange(len(plan.draft_rows))
    head = _head_of(plan.model)
    if grammar_output is None or head is None or not _checked.get(plan.model, True):
        _dense(plan, every)
        return
    mask_rows = _mask_rows_of(plan, scheduler_output, grammar_output, input_batch)
    sparse, rows, tokens = _allowed(np.asarray(grammar_output.grammar_bitmask), mask_rows, logits.shape[1])
    if len(rows):
        values = _sparse_logits(head, plan.hidden, rows, tokens)
        if plan.model not in _checked:
            first = rows[0]
            if not _agrees(plan, head, int(first), tokens[rows == first], values[torch.from_numpy(rows == first)]):
                _dense(plan, every)
                return
        target_rows = torch.from_numpy(plan.draft_rows[rows]).to(logits.device)
        logits[target_rows, torch.from_numpy(tokens).to(logits.device)] = values.to(logits.dtype)
    metrics.add("forced_rows_sparse", int(sparse.sum()))
    metrics.add("forced_logits_computed", len(rows))
    _dense(plan, every[~sparse])
