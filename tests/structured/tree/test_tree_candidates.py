"""Tree candidates: exact ragged candidates, the sparse layout's token map, and the step plan
(dense rows past the crossover, width buckets, the device-only plan)."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from logitgate import TreeDFA
from logitgate.structured.tree.candidates import (
    ENV_SPARSE_MAX_FRACTION,
    plan_tree_step,
    ragged_candidates,
    resolve_sparse_max_fraction,
)

VOCAB = 64


@st.composite
def trees_and_states(draw):
    seqs = draw(st.lists(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=4), min_size=1, max_size=12))
    tree = TreeDFA.from_sequences(seqs, end_token_id=0, vocab_size=VOCAB, cache=False)
    walks = draw(st.lists(st.sampled_from(seqs), min_size=1, max_size=8))
    states = []
    for seq in walks:
        depth = draw(st.integers(0, len(seq) + 1))  # past the end: the end token, then finished
        states.append(tree.walk((list(seq) + [0])[:depth]))
    states.append(tree.error_state)
    return tree, states


@given(case=trees_and_states())
def test_ragged_candidates_are_each_rows_allowed_tokens(case):
    tree, states = case
    ids, offsets = ragged_candidates(tree, torch.tensor(states, device=tree.device))
    assert offsets[-1] == ids.numel() == sum(len(tree.allowed(s)) for s in states)
    for i, s in enumerate(states):
        assert ids[offsets[i] : offsets[i + 1]].tolist() == tree.allowed(s)
    ids2, _ = ragged_candidates(tree, torch.tensor(states, device=tree.device), total=int(offsets[-1]))  # caller-given size
    assert torch.equal(ids, ids2)


@given(case=trees_and_states(), fraction=st.sampled_from([0.0, 0.03, 0.1, 1.0]), exact=st.sampled_from([None, False]))
def test_plan_covers_every_row_once_with_its_allowed_tokens(case, fraction, exact):
    tree, states = case
    # host_states: exact widths on any device (on the CPU they are read from the states anyway)
    plan = plan_tree_step(tree, torch.tensor(states, device=tree.device), VOCAB, host_states=states, sparse_max_fraction=fraction, exact=exact)
    seen = []
    if plan.dense is not None:
        seen += plan.dense.row_list
        if exact is None:
            assert all(len(tree.allowed(states[r])) > fraction * VOCAB for r in plan.dense.row_list)
    for group in plan.sparse:
        ids, valid = group.all_token_ids()
        assert ids.shape == (len(group.row_list), group.width)
        for i, r in enumerate(group.row_list):
            assert ids[i][valid[i]].tolist() == tree.allowed(states[r])
            if exact is None:
                assert len(tree.allowed(states[r])) <= fraction * VOCAB
        seen += group.row_list
    assert sorted(seen) == list(range(len(states)))
    assert len(plan.sparse) <= (2 if exact is None else 1)


def test_width_buckets_split_wide_from_narrow_rows():
    wide = [[t] for t in range(3, 3000)]  # the root allows ~3000 tokens, each child only the end token
    tree = TreeDFA.from_sequences(wide, end_token_id=0, vocab_size=8000, cache=False)
    states = [0] * 4 + [tree.walk([5])] * 60
    plan = plan_tree_step(tree, torch.tensor(states, device=tree.device), 8000, host_states=states, sparse_max_fraction=1.0)
    widths = sorted((len(g.row_list), g.width) for g in plan.sparse)
    assert widths == [(4, 2997), (60, 1)]
    assert plan.sparse_values == 4 * 2997 + 60
    dense = plan_tree_step(tree, torch.tensor(states, device=tree.device), 8000, host_states=states, sparse_max_fraction=0.1)
    assert dense.dense.row_list == [0, 1, 2, 3] and [g.row_list for g in dense.sparse] == [list(range(4, 64))]
    fixed = plan_tree_step(tree, torch.tensor(states, device=tree.device), 8000, sparse_max_fraction=1.0, exact=False)
    assert [(len(g.row_list), g.width) for g in fixed.sparse] == [(64, 2997)]
    assert plan_tree_step(tree, torch.tensor(states, device=tree.device), 8000, sparse_max_fraction=0.1, exact=False).all_dense


def test_host_states_are_checked():
    tree = TreeDFA.from_sequences([[5, 6]], end_token_id=0, vocab_size=VOCAB, cache=False)
    with pytest.raises(ValueError, match="state 99 is not a state"):
        plan_tree_step(tree, torch.tensor([0], device=tree.device), VOCAB, host_states=[99])
    with pytest.raises(ValueError, match="host_states has 2 entries for 1 states"):
        plan_tree_step(tree, torch.tensor([0], device=tree.device), VOCAB, host_states=[0, 0])
    with pytest.raises(ValueError, match="token id 6 but the logits have only 5 columns"):
        plan_tree_step(tree, torch.tensor([0], device=tree.device), 5)


def test_crossover_is_overridable(monkeypatch):
    assert resolve_sparse_max_fraction(0.2) == 0.2
    monkeypatch.setenv(ENV_SPARSE_MAX_FRACTION, "0.75")
    assert resolve_sparse_max_fraction() == 0.75
    monkeypatch.setenv(ENV_SPARSE_MAX_FRACTION, "lots")
    with pytest.raises(ValueError, match="LOGITGATE_TREE_SPARSE_MAX_FRACTION='lots'"):
        resolve_sparse_max_fraction()
    with pytest.raises(ValueError, match="sparse_max_fraction must be a number in"):
        resolve_sparse_max_fraction(1.5)


@given(case=trees_and_states())
def test_keep_only_allowed_equals_the_bitmask_masking(case):
    import logitgate
    from logitgate.structured.tree.candidates import keep_only_allowed

    tree, states = case
    logits = torch.randn(len(states), VOCAB + 7).to(tree.device)  # LM-head padding past the tree's vocabulary
    want = logits.clone()
    bitmask = logitgate.allocate_token_bitmask(len(states), VOCAB + 7, device=tree.device)
    tree.fill_bitmask(torch.tensor(states, device=tree.device), bitmask)
    logitgate.apply_token_bitmask_inplace(want, bitmask)
    assert torch.equal(keep_only_allowed(tree, logits, torch.tensor(states, device=tree.device)), want)


def test_keep_only_allowed_checks_its_inputs():
    from logitgate.structured.tree.candidates import keep_only_allowed

    tree = TreeDFA.from_sequences([[5, 6]], end_token_id=0, vocab_size=VOCAB, cache=False)
    with pytest.raises(ValueError, match="2 states for 1 logits rows"):
        keep_only_allowed(tree, torch.zeros(1, VOCAB, device=tree.device), torch.tensor([0, 0], device=tree.device))
    with pytest.raises(ValueError, match="token id 6 but the logits have only 4 columns"):
        keep_only_allowed(tree, torch.zeros(1, 4, device=tree.device), torch.tensor([0], device=tree.device))
    with pytest.raises(ValueError, match="logits are on meta but the tree is on"):
        keep_only_allowed(tree, torch.zeros(1, VOCAB, device="meta"), torch.tensor([0], device=tree.device))


def test_the_public_face_of_a_tree_is_its_allowed_sets():
    """What other layers read of a TreeDFA (host, allow_tok, allow_start, widths, check_states, check_device)
    describes the tree's allowed sets: state s allows allow_tok[allow_start[s] : + widths[s]]."""
    # On the CPU: states on the host are checked entry by entry there (on a device that would sync).
    tree = TreeDFA.from_sequences([[5, 6], [5, 7], [9]], end_token_id=0, vocab_size=VOCAB, device="cpu", cache=False)
    for state in range(tree.num_states):
        start, width = int(tree.allow_start[state]), int(tree.widths[state])
        assert tree.allow_tok[start : start + width].tolist() == tree.allowed(state)
        ptr = tree.host.allow_ptr
        assert tree.host.allow_tok[ptr[state] : ptr[state + 1]].tolist() == tree.allowed(state)
    states = torch.tensor([tree.root, tree.walk([5])])
    assert tree.check_states(states) is states
    with pytest.raises(ValueError, match=r"states\[1\] = 99 is not a state"):
        tree.check_states(torch.tensor([0, 99]))
    with pytest.raises(ValueError, match="tokens must be a 1-D"):
        tree.check_states(torch.zeros(2, 2, dtype=torch.int64), "tokens")
    tree.check_device(torch.zeros(1, VOCAB), "logits")
    with pytest.raises(ValueError, match="logits are on meta but the tree is on cpu"):
        tree.check_device(torch.zeros(1, VOCAB, device="meta"), "logits")
