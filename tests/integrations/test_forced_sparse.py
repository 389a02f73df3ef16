"""forced/sparse.py: draft rows computed over the tokens their mask rows allow give the masked
logits of whole rows (hypothesis, against the model's own compute_logits), in vLLM's layout of
the bitmask against the logits rows; rows without a narrow mask are computed whole."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from logitgate.integrations.vllm.forced import sparse


class _Processor(torch.nn.Module):
    def __init__(self, scale=1.0, soft_cap=None):
        super().__init__()
        self.scale, self.soft_cap, self.logits_as_input = scale, soft_cap, False

    def forward(self, lm_head, hidden):
        logits = torch.nn.functional.linear(hidden, lm_head.weight)
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return logits * self.scale


class _Model(torch.nn.Module):
    def __init__(self, vocab, hidden, seed, scale=1.0, soft_cap=None, bias=False):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight.data = torch.randn(vocab, hidden, generator=generator)
        self.logits_processor = _Processor(scale, soft_cap)
        self.bias = torch.randn(vocab, generator=generator) if bias else None

    def compute_logits(self, hidden):
        logits = self.logits_processor(self.lm_head, hidden)
        return logits if self.bias is None else logits + self.bias


def _bitmask(allowed: list[np.ndarray | None], vocab: int) -> np.ndarray:
    words = (vocab + 31) // 32
    out = np.zeros((len(allowed), words), dtype=np.int32)
    for row, tokens in enumerate(allowed):
        if tokens is None:
            out[row] = -1
            continue
        bits = np.zeros(words * 32, dtype=np.uint8)
        bits[tokens] = 1
        out[row] = np.packbits(bits.reshape(-1, 8)[:, ::-1]).view("<i4")
    return out


def _batch(draw_counts, vocab, rng, narrow):
    """A batch of requests with `draw_counts` drafts each: its plan, outputs and masks."""
    req_ids = [f"r{i}" for i in range(len(draw_counts))]
    spec = {rid: [1] * n for rid, n in zip(req_ids, draw_counts) if n}
    draft_rows, bonus_rows, row = [], [], 0
    for n in draw_counts:
        draft_rows += list(range(row, row + n))
        bonus_rows.append(row + n)
        row += n + 1
    structured = [rid for rid in req_ids if rng.random() < 0.9]
    rng.shuffle(structured)
    masks = []
    for rid in structured:
        n = len(spec.get(rid, ()))
        for _ in range(n + 1):
            kind = rng.random()
            if kind < narrow:
                masks.append(np.unique(rng.integers(0, vocab, size=rng.integers(0, 6))))
            elif kind < narrow + 0.1:
                masks.append(None)  # all ones
            else:
                masks.append(np.unique(rng.integers(0, vocab, size=vocab // 2)))
    return (SimpleNamespace(scheduled_spec_decode_tokens=spec),
            SimpleNamespace(structured_output_request_ids=structured, grammar_bitmask=_bitmask(masks, vocab)),
            SimpleNamespace(req_ids=req_ids), np.array(draft_rows, dtype=np.int64), np.array(bonus_rows, dtype=np.int64))


def _masked(logits, scheduler_output, grammar_output, input_batch):
    """vLLM's masking of whole rows (the reference): rows with a mask row keep its tokens only."""
    out = logits.clone()
    spec = scheduler_output.scheduled_spec_decode_tokens
    first, offset = {}, 0
    for index, rid in enumerate(input_batch.req_ids):
        first[rid] = index + offset
        offset += len(spec.get(rid, ()))
    mask_index = 0
    for rid in grammar_output.structured_output_request_ids:
        for i in range(1 + len(spec.get(rid, ()))):
            bits = np.unpackbits(grammar_output.grammar_bitmask[mask_index + i].view(np.uint8).reshape(-1, 1),
                                 axis=1)[:, ::-1].reshape(-1)[: logits.shape[1]]
            out[first[rid] + i, torch.from_numpy(bits == 0)] = float("-inf")
        mask_index += 1 + len(spec.get(rid, ()))
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=6), st.integers(33, 200), st.integers(0, 2**31 - 1),
       st.sampled_from([(1.0, None), (0.5, None), (1.0, 3.0)]), st.sampled_from([0.5, 0.9]))
def test_completed_rows_are_the_masked_whole_rows(draws, vocab, seed, tail, narrow):
    rng = np.random.default_rng(seed)
    model = _Model(vocab, 8, seed, *tail)
    scheduler_output, grammar_output, input_batch, draft_rows, bonus_rows = _batch(draws, vocab, rng, narrow)
    rows = len(draft_rows) + len(bonus_rows)
    hidden = torch.randn(rows + 3, 8, generator=torch.Generator().manual_seed(seed))
    positions = torch.randperm(rows + 3, generator=torch.Generator().manual_seed(seed + 1))[:rows]
    whole = model.compute_logits(hidden[positions])
    plan = sparse.Plan(model, draft_rows, bonus_rows)
    logits = sparse.expand(plan, whole[torch.from_numpy(bonus_rows)], hidden, positions)
    sparse.complete(logits, scheduler_output, grammar_output, input_batch)
    got = _masked(logits, scheduler_output, grammar_output, input_batch)
    want = _masked(whole, scheduler_output, grammar_output, input_batch)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


def test_rows_without_a_mask_and_wide_rows_are_computed_whole(monkeypatch):
    monkeypatch.setattr(sparse, "MAX_ALLOWED", 3)
    vocab, model = 64, _Model(64, 4, 1)
    hidden = torch.randn(4, 4)
    positions = torch.arange(4)
    plan = sparse.Plan(model, np.array([0, 1, 2]), np.array([3]))
    logits = sparse.expand(plan, model.compute_logits(hidden[3:]), hidden, positions)
    spec = {"a": [1, 2, 3]}
    masks = _bitmask([np.array([5]), np.arange(10), None, np.array([7])], vocab)
    sparse.complete(logits, SimpleNamespace(scheduled_spec_decode_tokens=spec),
                    SimpleNamespace(structured_output_request_ids=["a"], grammar_bitmask=masks), SimpleNamespace(req_ids=["a"]))
    whole = model.compute_logits(hidden)
    assert torch.allclose(logits[0, 5], whole[0, 5], atol=1e-5) and torch.isinf(logits[0]).sum() == vocab - 1
    assert torch.allclose(logits[1:], whole[1:], atol=1e-5)  # 10 allowed > 3: whole; all ones: whole; bonus row: the forward's


def test_no_grammar_output_computes_every_draft_row_whole():
    model = _Model(40, 4, 2)
    hidden = torch.randn(3, 4)
    plan = sparse.Plan(model, np.array([0, 1]), np.array([2]))
    logits = sparse.expand(plan, model.compute_logits(hidden[2:]), hidden, torch.arange(3))
    sparse.complete(logits)  # the rejection sampler's call: no mask came
    assert torch.allclose(logits, model.compute_logits(hidden), atol=1e-5)
    sparse.complete(logits)  # a second call changes nothing


def test_a_head_that_is_not_the_logits_is_found_once_and_left_whole():
    model = _Model(50, 4, 3, bias=True)  # compute_logits adds a bias the head matrix lacks
    hidden = torch.randn(2, 4)
    plan = sparse.Plan(model, np.array([0]), np.array([1]))
    logits = sparse.expand(plan, model.compute_logits(hidden[1:]), hidden, torch.arange(2))
    masks = _bitmask([np.array([1, 2]), None], 50)
    sparse.complete(logits, SimpleNamespace(scheduled_spec_decode_tokens={"a": [1]}),
                    SimpleNamespace(structured_output_request_ids=["a"], grammar_bitmask=masks), SimpleNamespace(req_ids=["a"]))
    assert torch.allclose(logits, model.compute_logits(hidden), atol=1e-5)
    runner = SimpleNamespace(speculative_config=None, is_pooling_model=False, broadcast_pp_output=False,
                             cache_config=SimpleNamespace(kv_sharing_fast_prefill=False), model=model)
    assert not sparse.plan_for(runner)  # this model's draft rows stay whole from now on
    assert sparse.plan_for(SimpleNamespace(**{**vars(runner), "model": _Model(50, 4, 4)}))


@pytest.mark.parametrize("value,expected", [(None, True), ("1", True), ("0", False)])
def test_the_switch(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(sparse.SPARSE_ENV, raising=False)
    else:
        monkeypatch.setenv(sparse.SPARSE_ENV, value)
    assert sparse.enabled() is expected


def test_a_malformed_switch_names_the_variable(monkeypatch):
    monkeypatch.setenv(sparse.SPARSE_ENV, "yes")
    with pytest.raises(ValueError, match="LOGITGATE_VLLM_FORCED_SPARSE='yes'"):
        sparse.enabled()
