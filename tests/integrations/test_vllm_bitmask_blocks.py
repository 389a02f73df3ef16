"""vLLM 0.33's bitmask layout against logitgate's fills (forced/fill.py, sample_first/scheduler.py,
forced/sparse.py), with vLLM 0.33's real StructuredOutputManager, xgrammar and the Llama-3 tokenizer.

vLLM 0.32 lays a batch's bitmask rows one request after another (a row per draft, then the bonus
row); vLLM 0.33 gives each request a block of num_speculative_tokens + 1 rows (its rows first, the
rest unused) and its apply_grammar_bitmask reads the block size off the bitmask. logitgate's
sharded fill sized its shards by the rows alone, so on vLLM 0.33 any structured request under a
--speculative-config failed the fill (xgrammar: "The provided index is out of bounds") and
stopped the engine. The same under vLLM 0.32 is tests/vllm_engine/test_forced_fill.py's."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm.v1.structured_output")  # vLLM's interface (make test installs what it imports)

from tests.helpers.real_tokenizers import real_tokenizer  # noqa: E402
from tests.vllm_engine.test_forced_fill import PREFIXES, forced_drafts, manager_with, positions  # noqa: E402


@pytest.fixture()
def tokenizer(monkeypatch):
    import vllm.v1.structured_output as structured_output

    tok = real_tokenizer("llama3")
    monkeypatch.setattr(structured_output, "cached_tokenizer_from_config", lambda model_config: tok)
    return tok


def _vllm_lays_blocks():
    from vllm.v1.structured_output import StructuredOutputManager

    from logitgate.integrations.vllm.forced.fill import fixed_blocks

    return fixed_blocks(StructuredOutputManager.grammar_bitmask)


pytestmark = pytest.mark.skipif(not _vllm_lays_blocks(), reason="this vLLM lays bitmask rows one request after another")


def _with_drafter(manager, drafts=3):
    manager.vllm_config.speculative_config = SimpleNamespace(method="ngram")
    manager.vllm_config.num_speculative_tokens = drafts
    manager._grammar_bitmask = None  # vLLM allocates it for its blocks


def _used(bitmask, ids, spec, stride):
    """The rows vLLM's apply_grammar_bitmask reads: the head of each request's block."""
    return np.concatenate([bitmask[i * stride : i * stride + 1 + len(spec.get(req_id, ()))] for i, req_id in enumerate(ids)])


@pytest.mark.parametrize("lengths", [[3, 0, 2, 3, 0, 1], [0] * 6])
def test_under_a_users_drafter_the_sharded_fill_gives_vllms_blocks(tokenizer, monkeypatch, lengths):
    from vllm.v1.structured_output import StructuredOutputManager

    from logitgate.integrations.vllm.forced import fill
    from logitgate.integrations.vllm.sample_first.scheduler import grammar_bitmask_replacement

    monkeypatch.setattr(fill, "usable_cores", lambda: 2)
    manager, requests = manager_with(tokenizer, "xgrammar", PREFIXES)
    _with_drafter(manager)
    spec = forced_drafts(tokenizer, requests, lengths)
    ids = list(requests)
    before = positions(manager, requests)
    replacement = grammar_bitmask_replacement(StructuredOutputManager.grammar_bitmask, "grammar_bitmask")
    out = replacement(manager, requests, ids, spec)
    assert manager.executor_for_fillmask.submitted.count("_fill_shard") == 2  # in parallel, on two shards
    assert (positions(manager, requests) == before).all()  # every grammar rolled back
    manager.fill_bitmask_parallel_threshold = 10**9
    expected = StructuredOutputManager.grammar_bitmask(manager, requests, ids, spec).copy()  # vLLM's serial fill
    assert fill.mask_stride(StructuredOutputManager.grammar_bitmask, manager.vllm_config) == 4
    assert out.shape == expected.shape == (4 * len(ids), expected.shape[1])
    np.testing.assert_array_equal(_used(out, ids, spec, 4), _used(expected, ids, spec, 4))
    assert (_used(out, ids, spec, 4) != -1).any()  # masks, not all-ones rows


def test_the_layout_is_read_from_vllms_code_under_logitgates_replacement():
    from vllm.v1.structured_output import StructuredOutputManager

    from logitgate.integrations.vllm.forced.fill import fixed_blocks
    from logitgate.integrations.vllm.sample_first.scheduler import grammar_bitmask_replacement

    assert fixed_blocks(grammar_bitmask_replacement(StructuredOutputManager.grammar_bitmask, "grammar_bitmask"))

    def rows_one_after_another(self, requests, ids, spec):  # vLLM 0.32's locals
        cumulative_index = 0
        return cumulative_index

    assert not fixed_blocks(rows_one_after_another)


def test_the_layout_of_a_block_bitmask():
    from logitgate.integrations.vllm.forced.fill import row_layout

    spec = {"a": [5, 6], "b": [], "c": [7]}
    total, rows_of = row_layout(["a", "b", "c"], spec, 4)
    assert total == 12
    assert rows_of(["a", "b", "c"]) == [0, 1, 2, 4, 8, 9]
    assert rows_of(["a", "c"], {"a"}) == [0, 1, 8, 9]
    compact_total, compact = row_layout(["a", "b", "c"], spec)
    assert compact_total == 6 and compact(["a", "b", "c"]) == list(range(6))


def test_more_drafts_than_a_block_holds_are_refused_by_name(tokenizer):
    from vllm.v1.structured_output import StructuredOutputManager

    from logitgate.integrations.vllm.forced import fill

    manager, requests = manager_with(tokenizer, "xgrammar", PREFIXES[:2])
    _with_drafter(manager, drafts=1)
    with pytest.raises(ValueError, match=r"2 drafts, more than this vLLM's bitmask holds per request \(1"):
        fill.fill_drafted(StructuredOutputManager.grammar_bitmask, manager, requests, ["r0"], {"r0": [1, 2]})


def test_without_a_speculative_config_no_forced_drafts_are_proposed_and_the_log_says_why(tokenizer, monkeypatch, caplog):
    """vLLM 0.33 gives each request one row without a speculative config: no room for forced drafts,
    which stay off there (they run under a --speculative-config, within its blocks)."""
    from logitgate.integrations.vllm.forced import proposals

    monkeypatch.setattr(proposals, "_logged", set())
    manager, requests = manager_with(tokenizer, "xgrammar", PREFIXES[1:2])
    manager.reasoner_cls = None
    manager.vllm_config.model_config.max_model_len = 4096
    request = requests["r0"]  # at a forced key: xgrammar would propose its tokens

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    with caplog.at_level(logging.INFO, logger="vllm.logitgate.forced"):
        assert proposals.propose(manager, request, 8, encode) == []
        assert proposals.propose(manager, request, 8, encode) == []
    said = [r.getMessage() for r in caplog.records if "forced drafts: off in this engine" in r.getMessage()]
    assert len(said) == 1 and "num_speculative_tokens + 1" in said[0], said
    monkeypatch.setattr(proposals.fill, "fixed_blocks", lambda original=None: False)  # vLLM 0.32's layout
    assert proposals.propose(manager, request, 8, encode)  # the same request proposes its forced tokens there
