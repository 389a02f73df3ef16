"""Edge cases of the tree kernels (gather candidates, keep only them, fill the tree bitmask) on
every backend against the torch reference: CSR tables whose rows are padded with -1 (never read),
empty rows (a row allowing nothing: all -inf, whatever its start points at), widths that are not
powers of two or wider than a tile, strided logits; and that the Triton backends really run their
Triton kernels (not the reference they fall back to). Token ids outside the logits are rejected
upstream (structured/tree/candidates.py), before any kernel."""
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from logitgate import TreeDFA
from logitgate.backends.base import CandidateRows
from logitgate.backends.reference import (
    fill_tree_bitmask_reference,
    gather_candidate_logits_reference,
    keep_candidate_logits_reference,
    unpack_bitmask,
)
from logitgate.structured.tree.candidates import keep_only_allowed, plan_tree_step
from tests.helpers.devices import to_device

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@st.composite
def padded_tables(draw):
    """A CSR table of sorted token lists (some empty), each followed by 0-3 slots of -1 padding;
    rows of a batch pick a list each (distinct batch rows)."""
    vocab = draw(st.integers(1, 200))
    lists = [
        sorted(draw(st.sets(st.integers(0, vocab - 1), max_size=min(vocab, draw(st.sampled_from([3, 17, 70]))))))
        for _ in range(draw(st.integers(1, 5)))
    ]
    starts, flat = [], []
    for tokens in lists:
        starts.append(len(flat))
        flat += tokens + [-1] * draw(st.integers(0, 3))
    batch = draw(st.integers(1, 6))
    rows = draw(st.lists(st.integers(0, batch - 1), max_size=batch, unique=True))
    picks = [draw(st.integers(0, len(lists) - 1)) for _ in rows]
    extra = draw(st.sampled_from([0, 0, 1, 5]))
    return vocab, lists, starts, flat, batch, rows, picks, extra, draw(st.integers(0, 2**16))


def _args(lists, starts, flat, rows, picks, extra):
    widths = torch.tensor([len(lists[p]) for p in picks], dtype=torch.int64)
    width = (int(widths.max()) if len(picks) else 0) + extra
    return CandidateRows(
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor([starts[p] for p in picks], dtype=torch.int64),
        widths,
        torch.tensor(flat, dtype=torch.int32),
        width,
    )


@given(case=padded_tables(), dtype=st.sampled_from(DTYPES), strided=st.booleans())
def test_gather_reads_only_the_candidates(case, dtype, strided, backend):
    vocab, lists, starts, flat, batch, rows, picks, extra, seed = case
    base = torch.randn(batch, vocab + 5, generator=torch.Generator().manual_seed(seed)).to(dtype)
    logits = base[:, 2 : vocab + 2] if strided else base[:, :vocab].contiguous()
    args = _args(lists, starts, flat, rows, picks, extra)
    got = backend.gather_candidate_logits(*to_device((logits, args), backend.device)).cpu()
    assert torch.equal(got, gather_candidate_logits_reference(logits, *args))
    for i, (r, p) in enumerate(zip(rows, picks)):
        assert got[i, : len(lists[p])].tolist() == logits[r, lists[p]].float().tolist()
        assert (got[i, len(lists[p]) :] == float("-inf")).all()


@given(case=padded_tables(), dtype=st.sampled_from(DTYPES), strided=st.booleans())
def test_keep_reads_only_the_candidates(case, dtype, strided, backend):
    vocab, lists, starts, flat, batch, rows, picks, extra, seed = case
    base = torch.randn(batch, vocab + 3, generator=torch.Generator().manual_seed(seed)).to(dtype)
    logits = base[:, :vocab] if strided else base[:, :vocab].contiguous()  # a row stride past the vocabulary
    args = _args(lists, starts, flat, rows, picks, extra)
    want = logits.clone()
    keep_candidate_logits_reference(want, *args)
    got = logits.clone().to(backend.device) if not strided else base.to(backend.device, copy=True)[:, :vocab]
    backend.keep_candidate_logits(got, to_device(args, backend.device))
    got = got.cpu()
    assert torch.equal(got, want)
    for r in range(batch):
        expected = logits[r].clone()
        if r in rows:
            allowed = lists[picks[rows.index(r)]]
            expected = torch.full((vocab,), float("-inf"), dtype=dtype)
            expected[allowed] = logits[r, allowed]  # an empty row: all -inf
        assert torch.equal(got[r], expected)


@pytest.mark.parametrize("width", [1, 31, 1000, 3000])  # 3000: several tiles of 1024 on CUDA
def test_wide_rows_cross_tiles(width, backend):
    vocab = 5000
    g = torch.Generator().manual_seed(width)
    lists = [sorted(torch.randperm(vocab, generator=g)[:w].tolist()) for w in (width, max(1, width // 3), 0)]
    starts = [0, width + 2, width + 2 + len(lists[1]) + 1]
    flat = lists[0] + [-1, -1] + lists[1] + [-1]
    rows, picks = [2, 0, 1], [0, 1, 2]
    logits = torch.randn(3, vocab, generator=g)
    args = _args(lists, starts, flat, rows, picks, 0)
    on_device = to_device(args, backend.device)
    gathered = backend.gather_candidate_logits(logits.to(backend.device), on_device).cpu()
    assert torch.equal(gathered, gather_candidate_logits_reference(logits, *args))
    got, want = logits.clone().to(backend.device), logits.clone()
    backend.keep_candidate_logits(got, on_device)
    got = got.cpu()
    keep_candidate_logits_reference(want, *args)
    assert torch.equal(got, want)
    assert torch.isinf(got[1]).all() and torch.equal(got[0, lists[1]], logits[0, lists[1]])


@given(
    vocab=st.integers(1, 400),
    lists=st.lists(st.sets(st.integers(0, 399), max_size=40), min_size=1, max_size=6),
    dense=st.lists(st.booleans(), min_size=6, max_size=6),
    picks=st.lists(st.integers(0, 5), max_size=6),
    extra_words=st.integers(0, 2),
    short_dense=st.booleans(),
)
def test_fill_tree_bitmask_with_padded_lists_and_empty_states(vocab, lists, dense, picks, extra_words, short_dense, backend):
    lists = [sorted(t for t in s if t < vocab) for s in lists]
    picks = [p % len(lists) for p in picks]
    starts, flat = [], []
    for tokens in lists:
        starts.append(len(flat))
        flat += tokens + [-1]
    fill_width = torch.tensor([0 if dense[i] else len(t) for i, t in enumerate(lists)], dtype=torch.int32)
    dense_ids = [i for i in range(len(lists)) if dense[i]]
    words = (vocab + 31) // 32 + extra_words
    dense_rows = dense_slot = None
    if dense_ids:
        from logitgate.backends.reference import pack_bitmask

        allowed = torch.zeros(len(dense_ids) + 1, vocab, dtype=torch.bool)
        for k, i in enumerate(dense_ids):
            allowed[k + 1, lists[i]] = True
        dense_rows = pack_bitmask(allowed)  # fewer words than the bitmask when extra_words > 0
        if short_dense and dense_rows.shape[1] > 1:
            keep = dense_rows.shape[1] - 1
            dense_rows = dense_rows[:, :keep].contiguous()
            for i in dense_ids:
                lists[i] = [t for t in lists[i] if t < keep * 32]
        dense_slot = torch.zeros(len(lists), dtype=torch.int64)
        dense_slot[dense_ids] = torch.arange(1, len(dense_ids) + 1)
    args = (
        torch.tensor(picks, dtype=torch.int64), torch.tensor(starts), torch.tensor(flat, dtype=torch.int32),
        fill_width, int(fill_width.max()), dense_rows, dense_slot,
    )
    got = torch.full((len(picks), words), 777, dtype=torch.int32, device=backend.device)
    want = got.cpu()  # a copy where got is on a device
    backend.fill_tree_bitmask(got, *to_device(args, backend.device))
    got = got.cpu()
    fill_tree_bitmask_reference(want, *args)
    assert torch.equal(got, want)
    bits = unpack_bitmask(got, words * 32)
    for r, p in enumerate(picks):
        expected = torch.zeros(words * 32, dtype=torch.bool)
        expected[lists[p]] = True
        assert torch.equal(bits[r], expected), (r, p)


def test_token_ids_past_the_logits_are_rejected_before_any_kernel(backend):
    tree = TreeDFA.from_sequences([[5, 40], [7]], end_token_id=0, vocab_size=64, device=backend)
    states = torch.tensor([tree.root], device=tree.device)
    with pytest.raises(ValueError, match="token id 40 but the logits have only 32 columns"):
        keep_only_allowed(tree, torch.zeros(1, 32, device=tree.device), states)
    with pytest.raises(ValueError, match="token id 40 but the logits have only 32 columns"):
        plan_tree_step(tree, states, 32)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_triton_backends_run_the_triton_tree_kernels(monkeypatch):
    """The Ascend-sized Triton path dispatches to logitgate.backends.triton.tree, not the reference."""
    from logitgate.backends import reference
    from logitgate.backends.emulated import EmulatedNpuBackend

    backend = EmulatedNpuBackend(triton_ascend=True, vector_cores=3)
    assert backend.kernels()["tree_candidates"].startswith("triton")
    assert backend.kernels()["fill_tree_bitmask"].startswith("triton")

    def refuse(*args, **kwargs):
        raise AssertionError("the torch reference ran")

    for name in ("gather_candidate_logits_reference", "keep_candidate_logits_reference", "fill_tree_bitmask_reference"):
        monkeypatch.setattr(reference, name, refuse)
    tree = TreeDFA.from_sequences([[5, 6], [5, 7], [9], [33, 1]], end_token_id=0, vocab_size=70, device=backend)
    states = torch.tensor([tree.root, tree.walk([5]), tree.walk([33])])
    logits = torch.randn(3, 70)
    plan = plan_tree_step(tree, states, 70, exact=False)
    [group] = plan.sparse
    gathered = group.gather(logits)
    assert gathered[0].tolist() == logits[0, [5, 9, 33]].tolist() and gathered[1, 2] == float("-inf")
    kept = keep_only_allowed(tree, logits.clone(), states)
    assert torch.isfinite(kept).sum(1).tolist() == [3, 2, 1]
    bitmask = torch.empty(3, 3, dtype=torch.int32)
    tree.fill_bitmask(states, bitmask)
    assert unpack_bitmask(bitmask, 70).sum(1).tolist() == [3, 2, 1]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@given(case=padded_tables(), block=st.sampled_from([16, 32, 1024]), programs=st.sampled_from([1, 2, 7, 1000]))
def test_triton_launchers_with_small_tiles_and_any_grid(case, block, programs):
    """Rows spanning several tiles, programs walking several work items (Ascend: few programs) or
    one each (CUDA: a big grid): the same results."""
    from logitgate.backends.triton.tree import (
        fill_tree_bitmask_triton,
        gather_candidate_logits_triton,
        keep_candidate_logits_triton,
    )

    vocab, lists, starts, flat, batch, rows, picks, extra, seed = case
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed))
    args = _args(lists, starts, flat, rows, picks, extra)
    launch = {"block": block, "max_programs": programs}
    assert torch.equal(gather_candidate_logits_triton(logits, *args, **launch), gather_candidate_logits_reference(logits, *args))
    got, want = logits.clone(), logits.clone()
    keep_candidate_logits_triton(got, *args, fill_block=block, **launch)
    keep_candidate_logits_reference(want, *args)
    assert torch.equal(got, want)
    rows_t, starts_t, widths, allow_tok, _ = args
    states = torch.arange(len(picks), dtype=torch.int64)
    words = (vocab + 31) // 32
    got_mask = torch.full((len(picks), words), -5, dtype=torch.int32)
    want_mask = got_mask.clone()
    fill_args = (states, starts_t, allow_tok, widths, int(widths.max()) if len(picks) else 0, None, None)
    fill_tree_bitmask_triton(got_mask, *fill_args, **launch)
    fill_tree_bitmask_reference(want_mask, *fill_args)
    assert torch.equal(got_mask, want_mask)
