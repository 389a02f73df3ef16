"""TreeDFA's batched API with states that are not states of the tree: on CPU every entry point
raises a ValueError naming the row (a negative state used to wrap to another state)."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import logitgate
from logitgate import TreeDFA

TREE = TreeDFA.from_sequences([[5, 6], [5, 7], [9]], end_token_id=0, vocab_size=40, device="cpu")


def entry_points(states):
    return {
        "advance": lambda: TREE.advance(states, torch.zeros_like(states)),
        "finished": lambda: TREE.finished(states),
        "fill_bitmask": lambda: TREE.fill_bitmask(states, logitgate.allocate_token_bitmask(len(states), 40)),
        "candidates": lambda: TREE.candidates(states),
    }


@pytest.mark.parametrize("bad", [-1, -3, TREE.num_states, TREE.num_states + 100, 2**31 - 1])
@pytest.mark.parametrize("name", ["advance", "finished", "fill_bitmask", "candidates"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_invalid_states_are_a_clear_error(name, bad, dtype):
    states = torch.tensor([TREE.root, bad], dtype=dtype)
    with pytest.raises(ValueError, match=rf"states\[1\] = {bad} is not a state of this tree \(0 <= state < {TREE.num_states}\)"):
        entry_points(states)[name]()


@given(states=st.lists(st.integers(0, TREE.num_states - 1), min_size=1, max_size=8), tokens=st.lists(st.integers(-5, 60), min_size=8, max_size=8))
def test_valid_states_and_any_tokens_agree_with_the_scalar_api(states, tokens):
    s = torch.tensor(states)
    t = torch.tensor(tokens[: len(states)])
    got = TREE.advance(s, t).tolist()
    for state, token, new in zip(states, t.tolist(), got):
        expected = TREE.step(state, token) if 0 <= token < 40 else (state if TREE.is_finished(state) else TREE.error_state)
        assert new == expected
    ids, valid = TREE.candidates(s)
    for row, state in enumerate(states):
        assert ids[row][valid[row]].tolist() == TREE.allowed(state)


def test_scalar_api_rejects_negative_and_non_integer_states():
    for bad in (-1, TREE.num_states, 1.0, True):
        with pytest.raises(ValueError, match="is not a state of this tree"):
            TREE.allowed(bad)
