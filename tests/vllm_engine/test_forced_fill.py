"""forced/fill.py against vLLM's own manager: a batch with forced drafts gets exactly the bitmask
vLLM's serial, draft-aware fill gives it, its drafted requests filled on shards in parallel where
vLLM's rule would fill the batch in parallel, its requests without drafts by vLLM's own fill."""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers.vllm_runtime import needs_vllm_cpu
from tests.vllm_engine.test_sample_first import ready, real_config, real_request

pytestmark = needs_vllm_cpu

RECORD = {"type": "object", "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}, "city": {"type": "string"}}}
PREFIXES = ["", '{"name":"Ann"', '{"name":"Bo","age":4,', '{"name":"C"', '{"name":"Dee","age":41,', ""]  # each at a forced string


class CountingPool(ThreadPoolExecutor):
    def __init__(self, workers):
        super().__init__(workers)
        self.submitted = []

    def submit(self, fn, *args, **kwargs):
        self.submitted.append(getattr(fn, "__name__", fn))
        return super().submit(fn, *args, **kwargs)


def manager_with(tok, backend, prefixes, threshold=1, workers=2, device="cpu"):
    """vLLM's manager, its parallel fill from `threshold` requests on a pool of `workers`, and one
    request per prefix (its output so far, accepted by its grammar)."""
    from vllm.v1.structured_output import StructuredOutputManager

    manager = StructuredOutputManager(real_config(device=device))
    manager.executor_for_fillmask = CountingPool(workers)
    manager.fill_bitmask_parallel_threshold, manager.fill_bitmask_parallel_batch_size = threshold, 1
    requests = {}
    for i, prefix in enumerate(prefixes):
        req = requests[f"r{i}"] = ready(manager, real_request(f"r{i}", backend, json=RECORD))
        for token in tok.encode(prefix, add_special_tokens=False):
            assert req.structured_output_request.grammar.accept_tokens(f"r{i}", [token])
            req.append_output_token_ids(token)
    return manager, requests


def forced_drafts(tok, requests, lengths):
    """Per request, up to `lengths[i]` tokens of the string its grammar forces next (as forced/
    proposes them), an empty list where it forces none."""
    from logitgate.structured.forced import xgrammar_forced_tokens

    def encode(text):
        return tok.encode(text, add_special_tokens=False)

    spec = {}
    for (req_id, req), n in zip(requests.items(), lengths):
        grammar = req.structured_output_request.grammar
        forced = xgrammar_forced_tokens(grammar.matcher, encode, n) if n else None
        spec[req_id] = list(forced.tokens) if forced else []
    return spec


def serial_fill(manager, requests, ids, spec):
    """vLLM's own fill of the batch, one request at a time (its draft-aware path)."""
    from vllm.v1.structured_output import StructuredOutputManager

    from logitgate.integrations.vllm.forced.fill import new_bitmask

    saved = manager.fill_bitmask_parallel_threshold, manager._grammar_bitmask
    manager.fill_bitmask_parallel_threshold = sys.maxsize
    manager._grammar_bitmask = new_bitmask(manager, sum(1 + len(spec.get(req_id, ())) for req_id in ids))
    try:
        return StructuredOutputManager.grammar_bitmask(manager, requests, ids, spec).copy()
    finally:
        manager.fill_bitmask_parallel_threshold, manager._grammar_bitmask = saved


def positions(manager, requests):
    """Each grammar's state, as the mask it gives now (either backend)."""
    from logitgate.integrations.vllm.forced.fill import new_bitmask

    masks = new_bitmask(manager, len(requests))
    for i, req in enumerate(requests.values()):
        req.structured_output_request.grammar.fill_bitmask(masks, i)
    return masks.numpy().copy()


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_drafted_batch_is_vllms_serial_fill_computed_on_parallel_shards(tokenizer, backend, caplog, monkeypatch):
    from vllm.v1.structured_output import StructuredOutputManager

    from logitgate.integrations.vllm.forced import fill

    monkeypatch.setattr(fill, "usable_cores", lambda: 2)  # a shard per core

    _, twins = manager_with(tokenizer, "xgrammar", PREFIXES)
    spec = forced_drafts(tokenizer, twins, [4, 3, 2, 5, 1, 3])  # the schema's forced strings, either backend
    assert all(spec.values())  # every request has drafts here
    manager, requests = manager_with(tokenizer, backend, PREFIXES)
    ids = list(requests)
    before = positions(manager, requests)
    expected = serial_fill(manager, requests, ids, spec)
    assert (positions(manager, requests) == before).all()
    out = fill.fill_drafted(StructuredOutputManager.grammar_bitmask, manager, requests, ids, spec)
    np.testing.assert_array_equal(out, expected)
    assert out.shape[0] == sum(1 + len(tokens) for tokens in spec.values())
    assert manager.executor_for_fillmask.submitted.count("_fill_shard") == 2  # two shards, one per worker
    assert (positions(manager, requests) == before).all()  # every grammar rolled back
    assert manager.fill_bitmask_parallel_threshold == 1  # the manager's own setting untouched
    assert (expected != -1).any(axis=1).all()  # every row constrains (each request's drafts are forced tokens)
    assert "rejected draft" not in caplog.text  # every grammar took its drafts


def test_below_vllms_parallel_threshold_the_drafted_fill_stays_serial(tokenizer):
    from vllm.v1.structured_output import StructuredOutputManager

    from logitgate.integrations.vllm.forced import fill

    manager, requests = manager_with(tokenizer, "xgrammar", PREFIXES, threshold=128)  # vLLM's default
    spec = forced_drafts(tokenizer, requests, [2] * len(PREFIXES))
    ids = list(requests)
    out = fill.fill_drafted(StructuredOutputManager.grammar_bitmask, manager, requests, ids, spec)
    np.testing.assert_array_equal(out, serial_fill(manager, requests, ids, spec))
    assert manager.executor_for_fillmask.submitted == []


def test_a_mixed_batch_takes_vllms_parallel_fill_for_its_requests_without_drafts(tokenizer, monkeypatch):
    """Requests without drafts go to vLLM's own fill (its parallel path: one task per request here),
    the drafted ones to the shards; the rows land in vLLM's layout."""
    from vllm.v1.structured_output import StructuredOutputManager

    from logitgate.integrations.vllm.forced import fill

    monkeypatch.setattr(fill, "usable_cores", lambda: 2)

    manager, requests = manager_with(tokenizer, "xgrammar", PREFIXES)
    spec = forced_drafts(tokenizer, requests, [3, 0, 2, 0, 4, 0])
    ids = list(requests)
    plain = [req_id for req_id in ids if not spec[req_id]]
    assert len(plain) == 3 and all(not tokens for tokens in (spec[r] for r in plain))
    expected = serial_fill(manager, requests, ids, spec)
    before = positions(manager, requests)
    vllm_fill = StructuredOutputManager.grammar_bitmask
    out = fill.grammar_bitmask(vllm_fill, manager, requests, ids, spec, lambda plain: vllm_fill(manager, requests, plain, {}))
    np.testing.assert_array_equal(out, expected)
    submitted = manager.executor_for_fillmask.submitted
    assert submitted.count("_fill_bitmasks") == len(plain)  # vLLM's parallel fill, batch size 1
    assert submitted.count("_fill_shard") == 2
    assert (positions(manager, requests) == before).all()


def test_the_manager_replacement_fills_a_drafted_batch_where_nothing_is_deferred(tokenizer):
    """Off the CPU (sample_first defers nothing there) the manager's replacement gives vLLM's serial
    bitmask; where vLLM's own method is in place the scheduler turns its parallel fill off while
    drafts run and makes room for their rows."""
    from vllm.v1.structured_output import StructuredOutputManager

    from logitgate.integrations.vllm.forced.scheduler import _vllm_fills_drafts, update_after_schedule_replacement
    from logitgate.integrations.vllm.sample_first.scheduler import grammar_bitmask_replacement

    manager, requests = manager_with(tokenizer, "xgrammar", PREFIXES, device="cuda")
    spec = forced_drafts(tokenizer, requests, [3, 0, 2, 5, 0, 1])
    ids = list(requests)
    replacement = grammar_bitmask_replacement(StructuredOutputManager.grammar_bitmask, "grammar_bitmask")
    out = replacement(manager, requests, ids, spec)
    np.testing.assert_array_equal(out, serial_fill(manager, requests, ids, spec))

    bitmask = manager._grammar_bitmask
    scheduler = SimpleNamespace(structured_output_manager=manager, vllm_config=manager.vllm_config)
    update = update_after_schedule_replacement(lambda self, output: None, "_update_after_schedule")
    assert _vllm_fills_drafts(manager)  # the class still has vLLM's method (nothing installed in this test)
    update(scheduler, SimpleNamespace(scheduled_spec_decode_tokens=spec))
    assert manager.fill_bitmask_parallel_threshold == sys.maxsize  # vLLM's own fill meets drafts: serial
    assert manager._grammar_bitmask.shape[0] >= sum(1 + len(t) for t in spec.values())
    update(scheduler, SimpleNamespace(scheduled_spec_decode_tokens={}))
    assert manager.fill_bitmask_parallel_threshold == 1  # put back
    manager._grammar_bitmask = bitmask


def test_with_the_replacement_installed_the_scheduler_leaves_the_manager_alone(tokenizer, monkeypatch):
    from vllm.v1.structured_output import StructuredOutputManager

    from logitgate.integrations.vllm.forced.scheduler import _vllm_fills_drafts, update_after_schedule_replacement
    from logitgate.integrations.vllm.sample_first.scheduler import grammar_bitmask_replacement

    manager, requests = manager_with(tokenizer, "xgrammar", PREFIXES[:2])
    monkeypatch.setattr(StructuredOutputManager, "grammar_bitmask",
                        grammar_bitmask_replacement(StructuredOutputManager.grammar_bitmask, "grammar_bitmask"))
    assert not _vllm_fills_drafts(manager)
    bitmask = manager._grammar_bitmask
    scheduler = SimpleNamespace(structured_output_manager=manager, vllm_config=manager.vllm_config)
    update = update_after_schedule_replacement(lambda self, output: None, "_update_after_schedule")
    update(scheduler, SimpleNamespace(scheduled_spec_decode_tokens={"r0": [1, 2]}))
    assert manager.fill_bitmask_parallel_threshold == 1 and manager._grammar_bitmask is bitmask


@given(st.lists(st.integers(1, 9), min_size=1, max_size=40), st.integers(1, 8))
def test_shards_are_contiguous_nonempty_runs_in_batch_order(rows, count):
    from logitgate.integrations.vllm.forced.fill import _shards

    ids = [f"r{i}" for i in range(len(rows))]
    shards = _shards(ids, rows, count)
    assert 1 <= len(shards) <= count
    assert [req_id for run, _ in shards for req_id in run] == ids
    assert all(run for run, _ in shards)
    assert [n for _, n in shards] == [sum(rows[ids.index(r)] for r in run) for run, _ in shards]
    if count <= len(rows):  # about equal: no shard over twice the mean plus one request's rows
        assert max(n for _, n in shards) <= 2 * sum(rows) / len(shards) + max(rows)


def test_under_a_users_drafter_the_whole_batch_fills_on_parallel_shards(tokenizer, monkeypatch):
    """vLLM fills every batch serially under a speculative config (its parallel path needs none):
    the manager's replacement gives the same bitmask from shards in parallel, for requests with
    drafts (a drafter's, grammar-checked ones padded with -1 as vLLM pads them) and without."""
    from vllm.v1.structured_output import StructuredOutputManager

    from logitgate.integrations.vllm.forced import fill
    from logitgate.integrations.vllm.sample_first.scheduler import grammar_bitmask_replacement

    monkeypatch.setattr(fill, "usable_cores", lambda: 2)
    manager, requests = manager_with(tokenizer, "xgrammar", PREFIXES)
    manager.vllm_config.speculative_config = SimpleNamespace(method="ngram")
    manager.vllm_config.num_speculative_tokens = 3
    spec = forced_drafts(tokenizer, requests, [3, 0, 2, 3, 0, 1])
    spec["r2"] = spec["r2"][:1] + [-1]  # a draft the grammar refused, padded
    ids = list(requests)
    expected = serial_fill(manager, requests, ids, spec)
    before = positions(manager, requests)
    replacement = grammar_bitmask_replacement(StructuredOutputManager.grammar_bitmask, "grammar_bitmask")
    out = replacement(manager, requests, ids, spec)
    np.testing.assert_array_equal(out, expected)
    assert manager.executor_for_fillmask.submitted.count("_fill_shard") == 2
    assert (positions(manager, requests) == before).all()
    no_drafts = replacement(manager, requests, ids, {})  # a batch without drafts: shards too
    np.testing.assert_array_equal(no_drafts, serial_fill(manager, requests, ids, {}))
    assert manager.executor_for_fillmask.submitted.count("_fill_shard") == 4
