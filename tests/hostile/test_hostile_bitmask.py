"""Bitmask helpers with wrong widths, wrong types and out-of-range values: a clear ValueError, never
a silently broadcast word or a truncated float."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import logitgate


def test_issue_repro_a_narrow_vocab_size_is_not_broadcast():
    bitmask = logitgate.allocate_token_bitmask(1, 100)
    with pytest.raises(ValueError, match=r"bitmask rows have 4 words but vocab_size 10 needs 1"):
        logitgate.fill_bitmask_row(bitmask, 0, [5], 10)
    assert bool((bitmask == -1).all())  # untouched


@given(words=st.integers(1, 8), vocab=st.integers(1, 300), ids=st.lists(st.integers(0, 299), max_size=6))
def test_fill_bitmask_row_allows_exactly_the_ids_or_raises(words, vocab, ids):
    bitmask = torch.full((2, words), -1, dtype=torch.int32)
    if words != (vocab + 31) // 32:
        with pytest.raises(ValueError, match="words but vocab_size"):
            logitgate.fill_bitmask_row(bitmask, 1, ids, vocab)
        assert bool((bitmask == -1).all())
    elif any(t >= vocab for t in ids):
        with pytest.raises(ValueError, match=r"token id \d+ in row 1 is outside the vocabulary"):
            logitgate.fill_bitmask_row(bitmask, 1, ids, vocab)
    else:
        logitgate.fill_bitmask_row(bitmask, 1, ids, vocab)
        assert logitgate.token_ids_from_bitmask(bitmask, vocab) == [list(range(vocab)), sorted(set(ids))]


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, [5.0], 100), r"token id 5.0 in row 0 is not an integer"),
        ((0, [True], 100), r"token id True in row 0 is not an integer"),
        ((0, [10**5000], 100), r"token id <an integer of about 5001 digits> in row 0 is outside"),
        ((-1, [5], 100), r"row -1 is outside \[0, 2\)"),
        ((0.0, [5], 100), r"row 0.0 is not an integer"),
        ((0, [5], 100.0), r"vocab_size must be a positive integer, got 100.0"),
        ((0, [5], True), r"vocab_size must be a positive integer, got True"),
        ((0, 5, 100), r"must be a list of ints"),
    ],
)
def test_fill_bitmask_row_bad_arguments(args, message):
    bitmask = logitgate.allocate_token_bitmask(2, 100)
    with pytest.raises(ValueError, match=message):
        logitgate.fill_bitmask_row(bitmask, *args)
    with pytest.raises(ValueError, match="2-D int32"):
        logitgate.fill_bitmask_row(bitmask.long(), 0, [1], 100)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(indices=[0.7]), r"indices row 0.7 is not an integer"),
        (dict(indices=[True]), r"indices row True is not an integer"),
        (dict(indices=[-1]), r"indices row -1 is outside"),
        (dict(vocab_size=40.0), r"vocab_size 40.0 must be an integer"),
        (dict(vocab_size=True), r"vocab_size True must be an integer"),
        (dict(vocab_size=torch.tensor(40)), r"vocab_size tensor\(40\) must be an integer"),
    ],
)
def test_apply_token_bitmask_bad_arguments_are_clear_errors(kwargs, message):
    logits = torch.randn(2, 100)
    before = logits.clone()
    with pytest.raises(ValueError, match=message):
        logitgate.apply_token_bitmask_inplace(logits, logitgate.allocate_token_bitmask(2, 100), **kwargs)
    assert torch.equal(logits, before)


def test_allocate_and_convert_bad_sizes():
    for bad in (40.0, True, 0, -3, torch.tensor(4)):
        with pytest.raises(ValueError, match="vocab_size"):
            logitgate.allocate_token_bitmask(1, bad)
        with pytest.raises(ValueError, match="vocab_size"):
            logitgate.bitmask_from_token_ids([[1]], bad)
    with pytest.raises(ValueError, match="batch_size"):
        logitgate.allocate_token_bitmask(1.5, 10)
    with pytest.raises(ValueError, match=r"token id 1.9 in row 0 is not an integer"):
        logitgate.bitmask_from_token_ids([[1.9]], 10)
