"""One answer to "is this an integer?" at every boundary (logitgate/checks.py): the shared checks,
SamplingParams and the tree loaders accept and refuse the same values. Python ints, int subclasses
(an IntEnum of special tokens) and numpy integers are integers, kept as plain ints; bools (Python's
and numpy's), floats, strings and tensors are not, even where int() would take them."""
import enum

import numpy as np
import pytest
import torch

from logitgate import TreeDFA
from logitgate.checks import as_token_id, is_integer, is_integer_type
from logitgate.sampling import SamplingParams
from logitgate.structured.tree.loaders import check_token_id


class Special(enum.IntEnum):
    FIVE = 5


class Token(int):
    pass


INTEGERS = [5, np.int64(5), np.int32(5), np.uint8(5), Special.FIVE, Token(5)]
NOT_INTEGERS = [True, False, np.bool_(True), 5.0, np.float32(5), "5", None, torch.tensor(5), [5]]


@pytest.mark.parametrize("value", INTEGERS, ids=lambda v: type(v).__name__)
def test_every_boundary_takes_an_integer_as_a_plain_int(value):
    assert is_integer(value) and is_integer_type(type(value))
    assert type(as_token_id(value, 32)) is int and type(check_token_id(value, "end_token_id", 32)) is int
    params = SamplingParams(top_k=value, seed=value, stop_token_ids=[value], logit_bias={value: 1.0})
    assert [type(x) for x in (params.top_k, params.seed, *params.stop_token_ids, *params.logit_bias)] == [int] * 4
    tree = TreeDFA.from_sequences([[value, 6]], end_token_id=0, vocab_size=32, cache=False)
    assert tree.allowed(tree.root) == [5]


@pytest.mark.parametrize("value", NOT_INTEGERS, ids=repr)
def test_every_boundary_refuses_what_is_not_an_integer(value):
    assert not is_integer(value) and not is_integer_type(type(value))
    with pytest.raises(ValueError, match="is not an integer"):
        as_token_id(value, 32)
    with pytest.raises(ValueError, match="is not an integer token id"):
        check_token_id(value, "end_token_id", 32)
    with pytest.raises(ValueError, match="top_k must be an int"):
        SamplingParams(top_k=value)
    with pytest.raises(ValueError, match="stop_token_ids has"):
        SamplingParams(stop_token_ids=[value])
    with pytest.raises(ValueError, match="is not an integer token id"):
        TreeDFA.from_sequences([[value, 6]], end_token_id=0, vocab_size=32, cache=False)
