"""Verification at the cost of the tokens the grammar allows (issue 37 c): a forced draft's
position is computed and verified over the tokens its mask row allows, never over the vocabulary.

At a forced position the grammar's mask allows a handful of tokens (the tokenizations of the rest
of the forced string: `"`, `"na`, `"name`...), and every other logit is -inf once the mask is
applied. vLLM would compute the LM head over the whole vocabulary at every draft position, then
mask, temper, filter and verify those full rows: on a small model that is most of the step. Here:

1. `_prepare_inputs` (worker.py) asks vLLM's forward for the logits of each request's last
   position only (its bonus row: the grammar may be free there), so the step's logits have one
   row per request, as in a batch without drafts, and records a `Plan`: the draft positions and
   (after the forward, `track`) their hidden states.
2. When the scheduler's bitmask reaches the runner (`take_masks`, from the apply_grammar_bitmask
   replacement), each draft row gets the logits of the tokens its mask allows, one dot product each
   (scaled and soft-capped as the model's LogitsProcessor does), kept as a (draft rows, K) table of
   values and token ids padded with -inf. A request with a row that is not narrow (a user's
   drafter's row where the grammar is free, a request without a grammar, a row allowing more than
   MAX_ALLOWED tokens) or with parameters vLLM applies through its processors (penalties, bad
   words...: proposals.why_not_drafted) is `dense`: its rows are computed whole by the model's
   compute_logits and masked with its bitmask rows, as vLLM would. vLLM's own
   apply_grammar_bitmask then masks the bonus rows.
3. The rejection sampler (`verify`, from worker.Verifier): the dense requests' drafts and every
   bonus token go through vLLM's own rejection pass (its processors, constraints and kernels) over
   their whole rows, the other requests counting no drafts there; the tabled requests' drafts then
   go through vLLM's apply_sampling_constraints (temperature / top-k / top-p over the allowed
   tokens, which is what they do to a masked row) and rejection_sample (logitgate's kernel under
   `rejection`) on the table, each draft token given as its column; the columns it returns are
   mapped back to token ids, and a request whose drafts are all accepted takes its bonus token.
   Without a dense request the bonus tokens come from vLLM's sampler over the bonus rows.

A masked row's softmax, argmax, top-k and top-p over the vocabulary equal the same over its allowed
tokens (the rest are -inf), so the emitted tokens follow vLLM's masked decoding (greedy: the same
argmax, ties to the lowest token id as torch's argmax; random: the same acceptance test and
recovered distribution). Batches where a request asks for logprobs, engines with custom logits
processors and drafters that read the target's rows (EAGLE, MTP, Medusa, draft models: only
TOKEN_DRAFTERS) are not planned (vLLM's full path). The first draft row of a model is checked against
its compute_logits: a head that is not a plain matrix (a bias, a quantized or sharded head) is
found there, and that model is verified over whole rows from then on (logged once).
`LOGITGATE_VLLM_FORCED_SPARSE=0` turns it off (the benchmarks' whole-row baseline).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .... import envs as _envs
from .. import metrics
from ..kernel_replacements import apply_mask_as_vllm
from .fill import fixed_blocks, row_layout

__all__ = ["MAX_ALLOWED", "SPARSE_ENV", "Plan", "enabled", "plan_for", "take_masks", "track", "verify"]

logger = logging.getLogger("logitgate")

SPARSE_ENV = "LOGITGATE_VLLM_FORCED_SPARSE"
# Past this many allowed tokens a row is one GEMM row of the head, cheaper than gathering the
# weight rows of its tokens (a forced position allows 1-8 here; a free one ~100k).
MAX_ALLOWED = 2048
_CHECK_RTOL = 1e-3
_MAX_PENDING = 8  # one batch in flight per runner, a runner or two per process

_checked: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()  # model -> sparse head agrees


def enabled(value: str | None = None) -> bool:
    """Whether draft rows are computed and verified sparsely (default on); ValueError naming the
    variable for anything but 0 / 1."""
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


# A user's drafters whose proposals come from tokens alone: they read no logits or hidden-state rows
# of the target, which the plan leaves out of the forward (EAGLE, MTP, Medusa and draft models do).
TOKEN_DRAFTERS = ("ngram", "suffix")


def plan_for(runner: Any) -> bool:
    """Whether this runner's batch with drafts is computed and verified sparsely: on, a plain head
    whose first check has not failed, vLLM's ordinary single-rank path, no speculative config or a
    token drafter's (TOKEN_DRAFTERS), no logprobs asked in the batch and no custom logits processors."""
    speculative = runner.speculative_config
    if not enabled() or getattr(runner, "is_pooling_model", False):
        return False
    if speculative is not None and getattr(speculative, "method", None) not in TOKEN_DRAFTERS:
        return False
    if getattr(runner, "broadcast_pp_output", False) or getattr(runner.cache_config, "kv_sharing_fast_prefill", False):
        return False
    if getattr(getattr(runner, "model_config", None), "logits_processors", None):
        return False
    metadata = getattr(getattr(runner, "input_batch", None), "sampling_metadata", None)
    if metadata is None or metadata.max_num_logprobs is not None:
        return False
    model = getattr(runner, "model", None)
    return model is not None and _checked.get(model, True) and _head_of(model) is not None


@dataclass
class Plan:
    """One batch's sparse verification. `num_drafts[r]` drafts of request r sit at draft rows
    cu[r] - num_drafts[r] ... cu[r] - 1; their hidden states come with `track`, their allowed
    tokens and logits with `take_masks` (or whole rows in `verify` when no mask came). A request is
    verified over its table (its rows' allowed tokens) where every draft row of it is narrow and
    `eligible`; otherwise (`dense`) by vLLM's own rejection pass over its whole, masked rows."""

    model: Any
    num_drafts: np.ndarray  # per request of the batch
    eligible: np.ndarray | None = None  # per request: its sampling parameters allow a table (None: all do)
    hidden: torch.Tensor | None = None  # (draft rows, hidden)
    tokens: torch.Tensor | None = None  # (draft rows, K) int64: allowed token ids, padded with 0
    values: torch.Tensor | None = None  # (draft rows, K) float32 logits, padded with -inf (dense requests' rows too)
    dense: np.ndarray | None = None  # per request: verified by vLLM's pass over whole rows
    dense_logits: torch.Tensor | None = None  # (the dense requests' draft rows, vocabulary) float32, masked

    @functools.cached_property
    def row_requests(self) -> np.ndarray:
        """Each draft row's request (num_drafts is fixed when the plan is made)."""
        return np.repeat(np.arange(len(self.num_drafts)), self.num_drafts)

    def group(self, members: np.ndarray, device: torch.device, cu_dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """A rejection pass over the requests in `members` (bool per request) alone: their draft
        counts with every other request's zeroed (int32), the counts' cumulative sum on `device`
        (vLLM's cu_num_draft_tokens), and which draft rows are theirs (bool on `device`)."""
        num = np.where(members, self.num_drafts, 0).astype(np.int32)
        cu = torch.from_numpy(np.cumsum(num)).to(device=device, dtype=cu_dtype)
        return num, cu, torch.from_numpy(members[self.row_requests]).to(device)


# id(the step's logits) -> (those logits, kept alive so the id is not reused; their plan), until verified
_pending: dict[int, tuple[torch.Tensor, Plan]] = {}


@torch.inference_mode()
def track(plan: Plan, logits: torch.Tensor, hidden_states: torch.Tensor, positions: torch.Tensor) -> None:
    """After the forward: `logits` (a row per request) is this plan's; `positions` are the token
    positions of the draft rows, whose hidden states are kept."""
    plan.hidden = hidden_states[positions]
    while len(_pending) >= _MAX_PENDING:  # entries of steps that failed before verification
        del _pending[next(iter(_pending))]
    _pending[id(logits)] = (logits, plan)


def plan_of(logits: torch.Tensor) -> Plan | None:
    """The plan of a step's logits (a row per request while it has one), else None."""
    held, plan = _pending.get(id(logits), (None, None))
    return plan if held is logits else None


def _draft_mask_rows(plan: Plan, scheduler_output: Any, grammar_output: Any, input_batch: Any) -> tuple[np.ndarray, list[int]]:
    """(each draft row's row in the scheduler's bitmask, -1 for none; each structured request's
    bonus row in it, in grammar_output's order), in vLLM's layout of that bitmask (fill.row_layout)."""
    spec = scheduler_output.scheduled_spec_decode_tokens
    ids = grammar_output.structured_output_request_ids
    # (where vLLM lays each request in a block of fixed size, it reads that size off the bitmask: so do we)
    stride = len(grammar_output.grammar_bitmask) // len(ids) if ids and fixed_blocks() else None
    _, rows_of = row_layout(ids, spec, stride)
    first_draft = np.concatenate([[0], np.cumsum(plan.num_drafts)])
    index = {req_id: i for i, req_id in enumerate(input_batch.req_ids)}
    mask_rows = np.full(int(first_draft[-1]), -1, dtype=np.int64)
    for req_id in ids:
        i = index.get(req_id)
        if i is not None and len(spec.get(req_id, ())) == plan.num_drafts[i]:
            mask_rows[first_draft[i] : first_draft[i + 1]] = rows_of([req_id], {req_id})
    return mask_rows, [rows_of([req_id])[-1] for req_id in ids]


def _allowed(bitmask: np.ndarray, mask_rows: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(narrow: the draft rows with a mask row allowing 1..MAX_ALLOWED tokens; their (row, token)
    pairs as two arrays, tokens ascending within a row). One scan of the draft rows' words, read
    64 bits at a time where a row has an even number of words (the scan is most of the cost)."""
    narrow = mask_rows >= 0
    picked = np.flatnonzero(narrow)
    words = np.ascontiguousarray(bitmask[mask_rows[picked]])
    pairs = words.shape[1] % 2 == 0 and sys.byteorder == "little"  # two words as one: token 64k + bit
    wide = words.view(np.uint64) if pairs else words.view(np.uint32)
    bits_per_word = 8 * wide.itemsize
    flat = np.flatnonzero(wide)
    row_of_word, word = np.divmod(flat, wide.shape[1])
    row_of_word = picked[row_of_word]  # a draft row's index
    nonzero_words = np.bincount(row_of_word, minlength=len(mask_rows))
    keep = nonzero_words[row_of_word] <= MAX_ALLOWED  # more nonzero words than that: more tokens too
    values = wide.ravel()[flat[keep]]
    row_of_word, word = row_of_word[keep], word[keep]
    bits = (values[:, None] >> np.arange(bits_per_word, dtype=wide.dtype)) & 1
    pair, bit = np.nonzero(bits)
    rows = row_of_word[pair]
    tokens = word[pair].astype(np.int64) * bits_per_word + bit
    inside = tokens < vocab
    rows, tokens = rows[inside], tokens[inside]
    counts = np.bincount(rows, minlength=len(mask_rows))
    narrow &= (counts > 0) & (counts <= MAX_ALLOWED)
    keep = narrow[rows]
    return narrow, rows[keep], tokens[keep]


def _head_logits(head: _Head, hidden: torch.Tensor, rows: np.ndarray, tokens: np.ndarray) -> torch.Tensor:
    """The head's logits of (draft row, token) pairs: one dot product each, accumulated in float32
    as a GEMM does, then the LogitsProcessor's soft cap and scale."""
    device = hidden.device
    values = (hidden[torch.from_numpy(rows).to(device)].float()
              * head.weight[torch.from_numpy(tokens).to(device)].float()).sum(-1)
    if head.soft_cap is not None:
        values = torch.tanh(values / head.soft_cap) * head.soft_cap
    if head.scale != 1.0:
        values = values * head.scale
    return values


def _agrees(plan: Plan, row: int, tokens: np.ndarray, values: torch.Tensor) -> bool:
    """Whether the model's own compute_logits gives one draft row's sparse values (once per model)."""
    expected = plan.model.compute_logits(plan.hidden[row : row + 1])[0, torch.from_numpy(tokens)].float()
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    ok = bool(torch.allclose(values.float().cpu(), expected.cpu(), rtol=_CHECK_RTOL, atol=_CHECK_RTOL * max(scale, 1.0)))
    _checked[plan.model] = ok
    if not ok:
        logger.warning("logitgate forced drafts: this model's logits are not its head's matrix product (a bias, a "
                       "quantized or sharded head); draft rows are computed whole from now on")
    return ok


def _table(plan: Plan, rows: np.ndarray, tokens: np.ndarray, values: torch.Tensor) -> None:
    """Lay (row, token, value) triples into the plan's padded (draft rows, K) table."""
    n = len(plan.hidden)
    counts = np.bincount(rows, minlength=n)
    width = max(int(counts.max()) if n else 0, 1)
    device = plan.hidden.device
    table_tokens = torch.zeros((n, width), dtype=torch.int64, device=device)
    table_values = torch.full((n, width), float("-inf"), dtype=torch.float32, device=device)
    if len(rows):
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        columns = np.arange(len(rows)) - starts[rows]
        index = (torch.from_numpy(rows).to(device), torch.from_numpy(columns).to(device))
        table_tokens[index] = torch.from_numpy(tokens).to(device)
        table_values[index] = values.float()
    plan.tokens, plan.values = table_tokens, table_values


def _dense_requests(plan: Plan, narrow: np.ndarray) -> np.ndarray:
    """Per request: a draft row of it is not narrow (a drafter's row where the grammar is free, a
    request without a grammar, a row past MAX_ALLOWED) or its parameters ask for vLLM's processors."""
    row_request = plan.row_requests
    table_ok = narrow if plan.eligible is None else narrow & plan.eligible[row_request]
    dense = np.zeros(len(plan.num_drafts), dtype=bool)
    dense[row_request[~table_ok]] = True
    return dense


def _dense_logits(plan: Plan, dense: np.ndarray, bitmask: np.ndarray | None, mask_rows: np.ndarray | None) -> None:
    """The dense requests' draft rows computed over the vocabulary by the model, each masked by its
    bitmask row where it has one (vLLM's binding of xgrammar, as its apply_grammar_bitmask)."""
    plan.dense = dense
    which = np.flatnonzero(dense[plan.row_requests])
    if len(which) == 0:
        plan.dense_logits = None
        return
    logits = plan.model.compute_logits(plan.hidden[torch.from_numpy(which).to(plan.hidden.device)]).float()
    if bitmask is not None and (mask_rows[which] >= 0).any():
        words = np.full((len(which), bitmask.shape[1]), -1, dtype=bitmask.dtype)  # all ones: no mask
        masked = mask_rows[which] >= 0
        words[masked] = bitmask[mask_rows[which[masked]]]
        apply_mask_as_vllm(logits, torch.from_numpy(words).to(logits.device))
    plan.dense_logits = logits
    metrics.add("forced_rows_whole", len(which))
    metrics.add("forced_logits_computed", len(which) * logits.shape[1])


@torch.inference_mode()
def take_masks(plan: Plan, logits: torch.Tensor, scheduler_output: Any, grammar_output: Any,
               input_batch: Any) -> tuple[Any, Any]:
    """The draft rows' allowed tokens and logits from the scheduler's bitmask (the dense requests'
    rows whole and masked); returns the (scheduler output, grammar output) that vLLM's
    apply_grammar_bitmask should apply to the step's `logits`, which have a row per request: its
    bonus rows only, as in a batch without drafts."""
    mask_rows, bonus_rows = _draft_mask_rows(plan, scheduler_output, grammar_output, input_batch)
    bitmask = np.asarray(grammar_output.grammar_bitmask)
    narrow, rows, tokens = _allowed(bitmask, mask_rows, logits.shape[1])
    head = _head_of(plan.model) if _checked.get(plan.model, True) else None
    if head is None:
        narrow[:] = False
    dense = _dense_requests(plan, narrow)
    keep = ~dense[plan.row_requests[rows]] if len(rows) else np.zeros(0, dtype=bool)
    rows, tokens = rows[keep], tokens[keep]
    values = _head_logits(head, plan.hidden, rows, tokens) if len(rows) else torch.zeros(0)
    if len(rows) and plan.model not in _checked:
        first = rows[0]
        if not _agrees(plan, int(first), tokens[rows == first], values[torch.from_numpy(rows == first)]):
            narrow[:] = False
            dense = _dense_requests(plan, narrow)
            rows, tokens, values = rows[:0], tokens[:0], values[:0]
    _table(plan, rows, tokens, values)
    _dense_logits(plan, dense, bitmask, mask_rows)
    metrics.add("forced_rows_sparse", int((~dense[plan.row_requests]).sum()))
    metrics.add("forced_logits_computed", len(rows))
    changes: dict[str, Any] = {"grammar_bitmask": bitmask[bonus_rows]}
    if getattr(grammar_output, "num_acceptable_drafts", None) is not None:
        changes["num_acceptable_drafts"] = [0] * len(bonus_rows)
    return SimpleNamespace(scheduled_spec_decode_tokens={}), dataclasses.replace(grammar_output, **changes)


def _vllm_pass(plan: Plan, rejection: Any, metadata: Any, logits: torch.Tensor, sampling_metadata: Any) -> torch.Tensor:
    """vLLM's rejection pass (`rejection(metadata, logits, sampling_metadata)`) over the dense
    requests' drafts and every request's bonus row; the other requests count no drafts in it (their
    bonus tokens are drawn there, their drafts are verified over their tables)."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    device = logits.device
    dtype = metadata.cu_num_draft_tokens.dtype
    num, cu, rows = plan.group(plan.dense, device, dtype)
    drafts = int(num.sum())
    reduced = SpecDecodeMetadata(
        draft_token_ids=metadata.draft_token_ids[rows].contiguous(), num_draft_tokens=num.tolist(),
        cu_num_draft_tokens=cu, cu_num_sampled_tokens=torch.from_numpy(np.cumsum(num + 1)).to(device=device, dtype=dtype),
        target_logits_indices=torch.arange(drafts, device=device, dtype=torch.int32),
        bonus_logits_indices=torch.arange(drafts, drafts + len(num), device=device, dtype=torch.int32),
        logits_indices=torch.arange(drafts + len(num), device=device, dtype=torch.int32))
    spec = getattr(sampling_metadata, "spec_token_ids", None)
    if spec is not None:  # vLLM's processors (penalties, bad words) read the drafts of the requests it verifies
        tabled = set(np.flatnonzero(~plan.dense).tolist())  # (the list may run past the batch: kept as it is)
        sampling_metadata = dataclasses.replace(
            sampling_metadata, spec_token_ids=[[] if i in tabled else ids for i, ids in enumerate(spec)])
    full = torch.cat([plan.dense_logits.to(logits.dtype), logits])
    return rejection(reduced, full, sampling_metadata).sampled_token_ids


def _table_pass(plan: Plan, metadata: Any, sampling_metadata: Any, bonus: torch.Tensor) -> torch.Tensor:
    """The table requests' drafts verified by vLLM's rejection_sample over their tables (the other
    requests count no drafts), each draft given as its column; `bonus` (a token per request) follows
    a request whose drafts are all accepted."""
    from vllm.v1.sample import rejection_sampler as rejection

    device = plan.tokens.device
    num, cu, rows = plan.group(~plan.dense & (plan.num_drafts > 0), device, metadata.cu_num_draft_tokens.dtype)
    tokens, values = plan.tokens[rows], plan.values[rows]
    drafts = metadata.draft_token_ids.to(device)[rows].long()
    found = tokens == drafts[:, None]
    # A draft's column in its row's table (a padded column, -inf, where its mask refuses it).
    pad = torch.full_like(drafts, tokens.shape[1])
    columns = torch.where(found.any(1), found.int().argmax(1), pad)
    values = torch.cat([values, torch.full((len(drafts), 1), float("-inf"), device=device)], 1)
    tokens = torch.cat([tokens, torch.zeros((len(drafts), 1), dtype=torch.int64, device=device)], 1)
    target = rejection.apply_sampling_constraints(values, cu, sampling_metadata)
    # The table's columns stand for tokens: the bonus tokens go in after (column 0 meanwhile).
    out = rejection.rejection_sample(columns.to(metadata.draft_token_ids.dtype).contiguous(), num.tolist(),
                                     int(num.max()), cu, None, target.contiguous(),
                                     torch.zeros_like(bonus).contiguous(), sampling_metadata)
    count = torch.from_numpy(num).to(out.device)
    position = torch.arange(out.shape[1], device=out.device)[None, :]
    at_draft = (position < count[:, None]) & (out >= 0)
    first = torch.cumsum(count, 0) - count
    row = (first[:, None] + position)[at_draft]
    out[at_draft] = tokens[row, out[at_draft].long()].to(out.dtype)
    at_bonus = (position == count[:, None]) & (out >= 0)  # every draft accepted
    out[at_bonus] = bonus.reshape(-1, 1).expand_as(out)[at_bonus].to(out.dtype)
    return out


@torch.inference_mode()
def verify(plan: Plan, sampler: Any, rejection: Any, metadata: Any, logits: torch.Tensor, sampling_metadata: Any) -> Any:
    """The step's output tokens (vLLM's SamplerOutput: a row per request, its accepted drafts then
    the recovered or bonus token, -1 after). The dense requests' drafts and every bonus token come
    from vLLM's rejection pass (`rejection(metadata, logits, sampling_metadata)`) over whole rows;
    when no request is dense, the bonus tokens from vLLM's `sampler` over `logits` (the masked bonus
    rows). The other requests' drafts are verified over their tables by vLLM's rejection_sample."""
    from vllm.v1.outputs import SamplerOutput

    _pending.pop(id(logits), None)
    if plan.dense is None:  # no mask reached the runner (no structured request): whole rows, every token
        empty = np.zeros(0, dtype=np.int64)
        _table(plan, empty, empty, torch.zeros(0))
        _dense_logits(plan, plan.num_drafts > 0, None, None)
    dense = plan.dense & (plan.num_drafts > 0)
    if dense.any():
        first = _vllm_pass(plan, rejection, metadata, logits, sampling_metadata)
    else:
        first = sampler(logits=logits, sampling_metadata=dataclasses.replace(sampling_metadata, max_num_logprobs=None),
                        predict_bonus_token=True).sampled_token_ids
    out = torch.full((len(plan.num_drafts), metadata.max_spec_len + 1), -1, dtype=first.dtype, device=first.device)
    out[:, : first.shape[1]] = first
    tabled = np.flatnonzero(~plan.dense & (plan.num_drafts > 0))
    if len(tabled):
        verified = _table_pass(plan, metadata, sampling_metadata, first[:, :1])
        index = torch.from_numpy(tabled).to(out.device)
        out[index] = -1
        out[index, : verified.shape[1]] = verified[index].to(out.dtype)
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)
