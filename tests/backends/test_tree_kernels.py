"""Backend.fill_tree_bitmask on every backend against a plain Python statement of its contract, on
random CSR tables, dense rows and states."""
import torch
from hypothesis import given
from hypothesis import strategies as st

from logitgate.backends.reference import gather_csr_rows, pack_bitmask, unpack_bitmask
from tests.helpers.devices import to_device


@st.composite
def tables(draw):
    vocab = draw(st.integers(1, 100))
    n_states = draw(st.integers(1, 8))
    rows = [sorted(draw(st.sets(st.integers(0, vocab - 1), min_size=1, max_size=min(vocab, 12)))) for _ in range(n_states)]
    dense = draw(st.lists(st.booleans(), min_size=n_states, max_size=n_states))
    states = draw(st.lists(st.integers(0, n_states - 1), max_size=6))
    extra_words = draw(st.integers(0, 2))
    return vocab, rows, dense, states, extra_words


@given(case=tables())
def test_fill_tree_bitmask_matches_its_contract(case, backend):
    vocab, rows, dense, states, extra_words = case
    starts = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)[:-1]
    tokens = torch.tensor([t for r in rows for t in r], dtype=torch.int32)
    widths = torch.tensor([len(r) for r in rows])
    fill_width = torch.where(torch.tensor(dense), 0, widths)
    slot = torch.zeros(len(rows), dtype=torch.int64)
    dense_ids = [i for i, d in enumerate(dense) if d]
    slot[dense_ids] = torch.arange(1, len(dense_ids) + 1)
    allowed = torch.zeros(len(dense_ids) + 1, vocab, dtype=torch.bool)
    for k, i in enumerate(dense_ids):
        allowed[k + 1, rows[i]] = True
    dense_rows = pack_bitmask(allowed) if dense_ids else None
    words = (vocab + 31) // 32 + extra_words
    bitmask = torch.full((len(states), words), 12345, dtype=torch.int32, device=backend.device)
    max_width = int(fill_width.max())
    args = (torch.tensor(states, dtype=torch.int64), starts, tokens, fill_width, max_width, dense_rows, slot if dense_ids else None)
    backend.fill_tree_bitmask(bitmask, *to_device(args, backend.device))
    got = unpack_bitmask(bitmask.cpu(), words * 32)
    for r, s in enumerate(states):
        expected = torch.zeros(words * 32, dtype=torch.bool)
        expected[rows[s]] = True
        assert torch.equal(got[r], expected), (r, s)


def test_gather_csr_rows_pads_with_the_first_entry():
    values = torch.tensor([7, 8, 9, 4])
    out, valid = gather_csr_rows(torch.tensor([1, 0]), torch.tensor([0, 3]), torch.tensor([3, 1]), values, 3)
    assert out.tolist() == [[4, 4, 4], [7, 8, 9]]
    assert valid.tolist() == [[True, False, False], [True, True, True]]
