import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from logitgate.backends.reference import apply_token_bitmask_reference, pack_bitmask
from logitgate.structured import apply_grammar_bitmask, grammar_bitmask_rows


def naive_apply(logits, bitmask, structured, batch, counts):
    """vLLM's loop, literally: walk the batch, find each structured request's first logit row,
    copy its 1 + drafts manager rows there, then mask row by row with the torch reference."""
    out = logits.clone()
    first_row, offset = {}, 0
    for request_id in batch:
        first_row[request_id] = offset
        offset += 1 + counts.get(request_id, 0)
    manager_row = 0
    for request_id in structured:
        n = 1 + counts.get(request_id, 0)
        if request_id in first_row:
            for i in range(n):
                one = out[first_row[request_id] + i : first_row[request_id] + i + 1]
                apply_token_bitmask_reference(one, bitmask[manager_row + i : manager_row + i + 1], None, out.shape[1])
        manager_row += n
    return out


@st.composite
def batches(draw):
    n = draw(st.integers(1, 6))
    batch = [f"r{i}" for i in range(n)]
    counts = {r: draw(st.integers(0, 3)) for r in batch if draw(st.booleans())}
    structured = draw(st.permutations(batch))[: draw(st.integers(0, n))]
    if draw(st.booleans()):
        structured = [*structured, "gone"]  # finished between scheduling and the forward pass
        counts["gone"] = draw(st.integers(0, 2))
    return batch, structured, counts


@given(case=batches(), vocab=st.sampled_from([33, 64, 100]), seed=st.integers(0, 2**16))
def test_reordering_with_mixed_draft_counts_matches_the_naive_loop(backend, case, vocab, seed):
    batch, structured, counts = case
    g = torch.Generator().manual_seed(seed)
    n_logits = sum(1 + counts.get(r, 0) for r in batch)
    n_manager = sum(1 + counts.get(r, 0) for r in structured)
    logits = torch.randn(n_logits, vocab, generator=g)
    bitmask = pack_bitmask(torch.rand(n_manager, vocab, generator=g) < 0.5)
    expected = naive_apply(logits, bitmask, structured, batch, counts)
    on_device = logits.to(backend.device)
    apply_grammar_bitmask(on_device, bitmask, structured, batch, counts, backend=backend)
    assert torch.equal(on_device.cpu(), expected)


def test_row_layout_and_draft_lists_count_like_ints():
    logit_rows, manager_rows, n_logits, n_manager = grammar_bitmask_rows(
        ["c", "a"], ["a", "b", "c"], {"a": [7, 8], "b": 1, "c": []}
    )
    # batch: a -> 0,1,2; b -> 3,4; c -> 5.  manager: c -> 0; a -> 1,2,3
    assert (logit_rows, manager_rows, n_logits, n_manager) == ([5, 0, 1, 2], [0, 1, 2, 3], 6, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unconstrained_rows_are_untouched_and_dtype_kept(backend, dtype):
    logits = torch.randn(5, 40).to(dtype)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)  # forbid everything...
    bitmask[:, 0] = 1  # ...but token 0
    before = logits.clone()
    on_device = logits.to(backend.device)
    apply_grammar_bitmask(on_device, bitmask, ["b"], ["a", "b", "c"], {"b": 1, "c": 1}, backend=backend)
    out = on_device.cpu()
    assert out.dtype == dtype
    assert torch.equal(out[0], before[0]) and torch.equal(out[3:], before[3:])
    assert torch.isinf(out[1:3, 1:]).all() and torch.equal(out[1:3, 0], before[1:3, 0])


def test_identity_layout_uses_the_bitmask_as_is(backend):
    logits = torch.randn(3, 32)
    bitmask = pack_bitmask(torch.rand(3, 32) < 0.5)
    expected = logits.clone()
    apply_token_bitmask_reference(expected, bitmask, None, 32)
    on_device = logits.to(backend.device)
    apply_grammar_bitmask(on_device, bitmask, ["a", "b"], ["a", "b"], {"a": 1}, backend=backend)
    assert torch.equal(on_device.cpu(), expected)


def test_bad_layouts_are_named():
    logits = torch.zeros(3, 32)
    bitmask = torch.full((2, 1), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="logits have 3 rows but the batch needs 2"):
        apply_grammar_bitmask(logits, bitmask, ["a"], ["a", "b"])
    with pytest.raises(ValueError, match="grammar_bitmask has 2 rows but .* need 3"):
        apply_grammar_bitmask(logits, bitmask, ["a", "b"], ["a", "b"], {"a": 1})
    with pytest.raises(ValueError, match="lists request 'a' twice"):
        apply_grammar_bitmask(logits, bitmask, ["a", "a"], ["a", "b"], {"a": 1})
    with pytest.raises(ValueError, match="negative draft count"):
        apply_grammar_bitmask(logits, bitmask, ["a"], ["a", "b"], {"a": -1})
    with pytest.raises(ValueError, match="2-D int32"):
        apply_grammar_bitmask(logits, bitmask[0], ["a"], ["a", "b"], {"a": 1})
