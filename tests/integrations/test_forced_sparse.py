"""forced/sparse.py: a draft row's table (allowed tokens, their logits) is the finite part of the
masked whole row (hypothesis, against the model's own compute_logits), in vLLM's layout of the
bitmask against the logits rows; a request with a row without a narrow mask (or parameters that
need vLLM's processors) is computed whole, masked as vLLM masks; vLLM's masking is handed the bonus
rows only. (verify: tests/vllm_engine/test_forced_sparse_verify.py)"""
from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace
from unittest import mock

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


@dataclasses.dataclass
class _GrammarOutput:  # vLLM's GrammarOutput's fields
    structured_output_request_ids: list
    grammar_bitmask: np.ndarray
    num_acceptable_drafts: list | None = None


@pytest.fixture(autouse=True)
def rows_one_after_another(monkeypatch):
    """vLLM 0.32's bitmask layout (the engine's; the interface installed here may be 0.33's, which
    lays a block per request: test_each_draft_rows_table_is_its_masked_whole_row draws both)."""
    monkeypatch.setattr(sparse, "fixed_blocks", lambda: False)


def _batch(draws, vocab, rng, narrow, blocks=False):
    """Requests with `draws` drafts each (a request with drafts is structured), some without a
    grammar: (scheduler output, grammar output, input batch, masks per structured request). With
    `blocks`, vLLM 0.33's layout: each request's rows head a block of 1 + max(draws) rows, the rest
    rows vLLM leaves unread (here: masks allowing token 0 alone, which no check expects)."""
    req_ids = [f"r{i}" for i in range(len(draws))]
    spec = {rid: [1] * n for rid, n in zip(req_ids, draws) if n}
    structured = [rid for rid, n in zip(req_ids, draws) if n or rng.random() < 0.7]
    rng.shuffle(structured)
    masks, per_request = [], {}
    for rid in structured:
        rows = []
        for _ in range(len(spec.get(rid, ())) + 1):
            kind = rng.random()
            if kind < narrow:
                rows.append(np.unique(rng.integers(0, vocab, size=rng.integers(0, 6))))
            elif kind < narrow + 0.1:
                rows.append(None)  # all ones
            else:
                rows.append(np.unique(rng.integers(0, vocab, size=vocab // 2)))
        per_request[rid] = rows
        masks += rows
        if blocks:
            masks += [np.array([0])] * (1 + max(draws) - len(rows))
    return (SimpleNamespace(scheduled_spec_decode_tokens=spec), _GrammarOutput(structured, _bitmask(masks, vocab)),
            SimpleNamespace(req_ids=req_ids), per_request)


def _finite(row: torch.Tensor, allowed) -> tuple[list, torch.Tensor]:
    tokens = list(range(len(row))) if allowed is None else sorted(int(t) for t in allowed)
    return tokens, row[tokens]


def _plan(model, draws, hidden_rows=None, seed=0):
    num = np.array(draws, dtype=np.int32)
    hidden = torch.randn(int(num.sum()), 8 if hidden_rows is None else hidden_rows,
                         generator=torch.Generator().manual_seed(seed))
    plan = sparse.Plan(model, num)
    logits = torch.zeros(len(draws), model.lm_head.weight.shape[0])  # a row per request, the vocabulary wide
    sparse.track(plan, logits, hidden, torch.arange(len(hidden)))
    return plan, logits, hidden


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=6), st.integers(33, 200), st.integers(0, 2**31 - 1),
       st.sampled_from([(1.0, None), (0.5, None), (1.0, 3.0)]), st.sampled_from([0.5, 0.9]), st.booleans())
def test_each_draft_rows_table_is_its_masked_whole_row(draws, vocab, seed, tail, narrow, blocks):
    rng = np.random.default_rng(seed)
    model = _Model(vocab, 8, seed, *tail)
    scheduler_output, grammar_output, input_batch, per_request = _batch(draws, vocab, rng, narrow, blocks)
    plan, logits, hidden = _plan(model, draws, seed=seed)
    assert sparse.plan_of(logits) is plan
    logits = torch.zeros(len(draws), vocab)
    sparse.track(plan, logits, hidden, torch.arange(len(hidden)))
    with mock.patch.object(sparse, "fixed_blocks", lambda: blocks):  # the layout this vLLM writes
        bonus_scheduler_output, bonus_output = sparse.take_masks(plan, logits, scheduler_output, grammar_output,
                                                                 input_batch)
    whole = model.compute_logits(hidden)
    first = np.concatenate([[0], np.cumsum(draws)])
    dense_row = 0
    for i, rid in enumerate(input_batch.req_ids):
        allowed = [vocab if m is None else len(m) for m in per_request.get(rid, [])[: draws[i]]]
        narrow = [0 < count <= sparse.MAX_ALLOWED for count in allowed]
        assert plan.dense[i] == (draws[i] > 0 and not all(narrow))  # a request's rows go one way
        for j in range(draws[i]):
            row = first[i] + j
            tokens, values = _finite(whole[row], per_request[rid][j])
            if plan.dense[i]:  # its whole row, masked as vLLM masks it
                expected = torch.full((vocab,), float("-inf"))
                expected[tokens] = values
                assert torch.allclose(plan.dense_logits[dense_row], expected, rtol=1e-5, atol=1e-5)
                dense_row += 1
                continue
            got = plan.values[row]
            assert plan.tokens[row, : len(tokens)].tolist() == tokens
            assert torch.isinf(got[len(tokens):]).all()
            assert torch.allclose(got[: len(tokens)], values.float(), rtol=1e-5, atol=1e-5)
    assert dense_row == (0 if plan.dense_logits is None else len(plan.dense_logits))
    # vLLM's masking gets the bonus rows, a row per structured request, as in a batch without drafts
    assert bonus_scheduler_output.scheduled_spec_decode_tokens == {}
    bonus = [per_request[rid][-1] for rid in grammar_output.structured_output_request_ids]
    assert np.array_equal(bonus_output.grammar_bitmask, _bitmask(bonus, vocab))
    assert bonus_output.structured_output_request_ids == grammar_output.structured_output_request_ids


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 2000), st.integers(0, 2**31 - 1), st.integers(1, 40))
def test_the_allowed_tokens_of_each_draft_row_are_its_mask_bits(vocab, seed, max_allowed):
    """_allowed reads the mask rows 64 bits at a time (even word counts) or 32: the same (row, token)
    pairs as unpacking each row bit by bit; rows past max_allowed, empty or without a mask are not narrow."""
    rng = np.random.default_rng(seed)
    words = (vocab + 31) // 32
    bitmask = rng.integers(-(2**31), 2**31, size=(6, words), dtype=np.int64).astype(np.int32)
    bitmask[rng.random(bitmask.shape) < rng.random()] = 0  # sparse rows, some empty
    mask_rows = rng.integers(-1, 6, size=5)
    old = sparse.MAX_ALLOWED
    sparse.MAX_ALLOWED = max_allowed
    try:
        narrow, rows, tokens = sparse._allowed(bitmask, mask_rows, vocab)
    finally:
        sparse.MAX_ALLOWED = old
    for r, m in enumerate(mask_rows):
        bits = np.unpackbits(bitmask[m].view(np.uint8), bitorder="little")[:vocab] if m >= 0 else np.zeros(0)
        expected = np.flatnonzero(bits)
        assert narrow[r] == (m >= 0 and 0 < len(expected) <= max_allowed)
        assert tokens[rows == r].tolist() == (expected.tolist() if narrow[r] else [])


def test_a_request_with_a_wide_or_empty_row_is_computed_whole_within_its_masks(monkeypatch):
    monkeypatch.setattr(sparse, "MAX_ALLOWED", 3)
    vocab, model = 64, _Model(64, 8, 1)
    plan, logits, hidden = _plan(model, [4, 2])
    masks = [np.array([5]), np.arange(10), None, np.array([], dtype=np.int64), np.array([7]),
             np.array([1, 2]), np.array([3]), None]
    sparse.take_masks(plan, logits, SimpleNamespace(scheduled_spec_decode_tokens={"a": [1] * 4, "b": [1] * 2}),
                      _GrammarOutput(["a", "b"], _bitmask(masks, vocab)), SimpleNamespace(req_ids=["a", "b"]))
    assert plan.dense.tolist() == [True, False]
    whole = model.compute_logits(hidden)
    for row, allowed in enumerate(masks[:4]):  # request a: every row whole, masked
        tokens, values = _finite(whole[row], allowed)
        expected = torch.full((vocab,), float("-inf"))
        expected[tokens] = values
        assert torch.allclose(plan.dense_logits[row], expected, atol=1e-5)
    for row, allowed in ((4, masks[5]), (5, masks[6])):  # request b: its table
        assert plan.tokens[row, : len(allowed)].tolist() == allowed.tolist()
        assert torch.allclose(plan.values[row, : len(allowed)], whole[row, allowed], atol=1e-5)


def test_a_request_whose_parameters_need_vllms_processors_is_computed_whole():
    vocab, model = 40, _Model(40, 8, 2)
    plan, logits, hidden = _plan(model, [1, 1])
    plan.eligible = np.array([False, True])
    sparse.take_masks(plan, logits, SimpleNamespace(scheduled_spec_decode_tokens={"a": [1], "b": [1]}),
                      _GrammarOutput(["a", "b"], _bitmask([np.array([3]), None, np.array([4]), None], vocab)),
                      SimpleNamespace(req_ids=["a", "b"]))
    assert plan.dense.tolist() == [True, False]
    assert len(plan.dense_logits) == 1 and torch.isinf(plan.dense_logits[0, [0, 1, 2, 4]]).all()


def test_the_dense_rows_are_masked_through_vllms_binding_of_xgrammar(monkeypatch):
    """The call vLLM's apply_grammar_bitmask makes (logitgate's kernel where `bitmask` patched the
    binding), not xgrammar's own CPU kernel."""
    import xgrammar

    calls = []

    def apply(logits, bitmask, **kwargs):
        calls.append(len(logits))
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, **kwargs)

    utils = SimpleNamespace(xgr=SimpleNamespace(apply_token_bitmask_inplace=apply))  # as vLLM's, patched
    monkeypatch.setitem(sys.modules, "vllm.v1.structured_output.utils", utils)
    vocab, model = 40, _Model(40, 8, 2)
    plan, logits, hidden = _plan(model, [2])
    plan.eligible = np.array([False])
    sparse.take_masks(plan, logits, SimpleNamespace(scheduled_spec_decode_tokens={"a": [1, 1]}),
                      _GrammarOutput(["a"], _bitmask([np.array([3]), np.array([4, 5]), None], vocab)),
                      SimpleNamespace(req_ids=["a"]))
    assert calls == [2]
    assert torch.isfinite(plan.dense_logits[0]).sum() == 1 and torch.isfinite(plan.dense_logits[1]).sum() == 2


def test_without_vllms_module_the_mask_is_xgrammars_own(monkeypatch):
    """apply_mask_as_vllm (the dense rows' and sample_first's mask) outside an engine: xgrammar's
    kernel, the rows named by `indices` masked and the others untouched."""
    from logitgate.integrations.vllm.kernel_replacements import apply_mask_as_vllm

    monkeypatch.delitem(sys.modules, "vllm.v1.structured_output.utils", raising=False)
    logits = torch.zeros(3, 40)
    bitmask = torch.from_numpy(_bitmask([np.array([3]), np.array([4, 5]), np.array([6])], 40).astype(np.int32))
    apply_mask_as_vllm(logits, bitmask, indices=[0, 2])
    assert torch.isfinite(logits).sum(dim=1).tolist() == [1, 40, 1]
    assert logits[0, 3] == 0 and logits[2, 6] == 0


def test_a_head_that_is_not_the_logits_is_found_once_and_left_whole():
    model = _Model(50, 8, 3, bias=True)  # compute_logits adds a bias the head matrix lacks
    plan, logits, hidden = _plan(model, [1])
    sparse.take_masks(plan, logits, SimpleNamespace(scheduled_spec_decode_tokens={"a": [1]}),
                      _GrammarOutput(["a"], _bitmask([np.array([1, 2]), None], 50)), SimpleNamespace(req_ids=["a"]))
    assert plan.dense.tolist() == [True]
    assert torch.allclose(plan.dense_logits[0, [1, 2]], model.compute_logits(hidden)[0, [1, 2]], atol=1e-5)
    runner = SimpleNamespace(speculative_config=None, is_pooling_model=False, broadcast_pp_output=False,
                             cache_config=SimpleNamespace(kv_sharing_fast_prefill=False), model=model,
                             model_config=SimpleNamespace(logits_processors=None),
                             input_batch=SimpleNamespace(sampling_metadata=SimpleNamespace(max_num_logprobs=None)))
    assert not sparse.plan_for(runner)  # this model's draft rows stay whole from now on
    fresh = {**vars(runner), "model": _Model(50, 8, 6)}
    assert sparse.plan_for(SimpleNamespace(**{**fresh, "speculative_config": SimpleNamespace(method="ngram")}))
    assert not sparse.plan_for(SimpleNamespace(**{**fresh, "speculative_config": SimpleNamespace(method="eagle3")}))
    assert sparse.plan_for(SimpleNamespace(**{**vars(runner), "model": _Model(50, 8, 4)}))
    logprobs = SimpleNamespace(sampling_metadata=SimpleNamespace(max_num_logprobs=2))
    assert not sparse.plan_for(SimpleNamespace(**{**vars(runner), "model": _Model(50, 8, 5), "input_batch": logprobs}))


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
