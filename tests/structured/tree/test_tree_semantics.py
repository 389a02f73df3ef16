"""TreeDFA against the pure-Python models of RTP-LLM's string-key DFA and of a token trie, step for
step, on hypothesis-generated trees and token streams (valid, unknown and end tokens; several
separators); and the batched device ops against the scalar ones on every backend."""
import torch
from hypothesis import given
from hypothesis import strategies as st

import logitgate
from logitgate import TreeDFA
from tests.helpers.rtp_reference import RtpStringTreeDFA, SequenceTrieModel

ALPHABET = list(range(3, 15))  # small, so keys collide and candidates lead to existing keys
VOCAB = 64
UNKNOWN = 60  # a token no tree below uses
SEPS = ["_", "-", ",", "->", " ", "|"]


@st.composite
def prefix_dicts(draw):
    sep = draw(st.sampled_from(SEPS))
    start = draw(st.sampled_from([1, 40, 5]))  # 5 is also a tree token
    end = draw(st.sampled_from([2, 0, 7]))  # 7 is also a tree token
    paths = draw(st.lists(st.lists(st.sampled_from(ALPHABET + [end]), max_size=4), max_size=25))
    keys = {(): None}
    for path in paths:
        for i in range(len(path) + 1):  # usually with every intermediate key ...
            if i == len(path) or draw(st.integers(0, 9)):  # ... sometimes one is missing
                keys[tuple(path[:i])] = None
    if draw(st.booleans()):
        del keys[()]  # no start key: the root falls back to the end token
    cand_tokens = st.sampled_from(ALPHABET + [end])
    prefix_dict = {
        sep.join(map(str, (start, *path))): draw(st.lists(cand_tokens, max_size=5)) for path in keys
    }
    for other in draw(st.lists(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=3), max_size=3)):
        prefix_dict[sep.join(map(str, other))] = [draw(cand_tokens)]  # keys under other start tokens
    return {"start_token_id": start, "end_token_id": end, "sep": sep, "prefix_dict": prefix_dict}


def draw_token(data, allowed, end):
    kind = data.draw(st.sampled_from(["allowed", "allowed", "alphabet", "end", "unknown"]))
    if kind == "allowed":
        return data.draw(st.sampled_from(allowed))
    return {"alphabet": data.draw(st.sampled_from(ALPHABET)), "end": end, "unknown": UNKNOWN}[kind]


def check_batched(tree, scalar_states, backend):
    states = torch.tensor(scalar_states, dtype=torch.int64, device=tree.device)
    expected = [tree.allowed(s) for s in scalar_states]
    bitmask = logitgate.allocate_token_bitmask(len(states), VOCAB, device=tree.device)
    tree.fill_bitmask(states, bitmask)
    assert logitgate.token_ids_from_bitmask(bitmask, VOCAB) == expected
    ids, valid = tree.candidates(states)
    assert [ids[r][valid[r]].tolist() for r in range(len(states))] == expected
    assert ids.shape[1] == tree.max_width
    assert (ids == ids[:, :1]).logical_or(valid).all()  # padding repeats the first token
    assert tree.finished(states).tolist() == [tree.is_finished(s) for s in scalar_states]


@given(config=prefix_dicts(), dense=st.sampled_from([1, 3, 10**9]), data=st.data())
def test_prefix_dict_matches_rtp_string_dfa(config, dense, data, backend):
    tree = TreeDFA.from_prefix_dict(config, vocab_size=VOCAB, device=backend, dense_min_width=dense)
    end = config["end_token_id"]
    n_streams = data.draw(st.integers(1, 4))
    refs = [RtpStringTreeDFA(config["prefix_dict"], config["start_token_id"], end, config["sep"]) for _ in range(n_streams)]
    scalar = [tree.root] * n_streams
    batched = tree.initial_states(n_streams)
    for _ in range(data.draw(st.integers(0, 7))):
        for ref, state in zip(refs, scalar):
            assert tree.allowed(state) == ref.candidates()
            assert tree.is_finished(state) == ref.is_finished()
        check_batched(tree, scalar, backend)
        tokens = [draw_token(data, ref.candidates(), end) for ref in refs]
        for ref, tok in zip(refs, tokens):
            ref.next(tok)
        scalar = [tree.step(s, t) for s, t in zip(scalar, tokens)]
        batched = tree.advance(batched, torch.tensor(tokens, device=tree.device))
        assert batched.tolist() == scalar
    for ref, state in zip(refs, scalar):
        assert tree.allowed(state) == ref.candidates()
        assert tree.is_finished(state) == ref.is_finished()


@st.composite
def sequence_sets(draw):
    end = draw(st.sampled_from([0, 2]))
    seqs = draw(st.lists(st.lists(st.sampled_from(ALPHABET), max_size=5), min_size=1, max_size=15))
    return seqs, end


@given(case=sequence_sets(), dense=st.sampled_from([1, 10**9]), data=st.data())
def test_sequences_match_trie_model(case, dense, data, backend):
    seqs, end = case
    tree = TreeDFA.from_sequences(seqs, end_token_id=end, vocab_size=VOCAB, device=backend, dense_min_width=dense)
    refs = [SequenceTrieModel(seqs, end) for _ in range(3)]
    scalar = [tree.root] * 3
    batched = tree.initial_states(3).to(torch.int32)  # int32 states work too
    for _ in range(data.draw(st.integers(0, 7))):
        assert [tree.allowed(s) for s in scalar] == [ref.candidates() for ref in refs]
        check_batched(tree, scalar, backend)
        tokens = [draw_token(data, ref.candidates(), end) for ref in refs]
        for ref, tok in zip(refs, tokens):
            ref.next(tok)
        scalar = [tree.step(s, t) for s, t in zip(scalar, tokens)]
        batched = tree.advance(batched, torch.tensor(tokens, dtype=torch.int32, device=tree.device))
        assert batched.dtype == torch.int32 and batched.tolist() == scalar
    assert [tree.allowed(s) for s in scalar] == [ref.candidates() for ref in refs]


def test_rtp_seed_example_and_fallbacks():
    config = {"start_token_id": 225, "end_token_id": 2, "sep": "_",
              "prefix_dict": {"225_64000": [64001, 64002], "225_64000_64001": [2], "225_64000_64003": []}}
    tree = TreeDFA.from_prefix_dict(config)
    assert tree.allowed(tree.root) == [2]  # the start key is missing: end-token fallback
    s = tree.step(tree.root, 64000)  # ... but the key "225_64000" exists, so the token moves there
    assert tree.allowed(s) == [64001, 64002]
    assert tree.allowed(tree.step(s, 64001)) == [2]
    assert tree.step(s, 64002) == tree.error_state  # a candidate without a key: error, only the end token
    empty = tree.step(s, 64003)  # a key with an empty list: the end token, but not an error
    assert empty != tree.error_state and tree.allowed(empty) == [2]
    assert tree.step(tree.error_state, 64000) == tree.error_state
    done = tree.step(tree.error_state, 2)
    assert done == tree.finished_state and tree.is_finished(done)
    assert tree.step(done, 64000) == done and tree.allowed(done) == [2]


def test_key_after_end_token_is_a_frozen_state_with_its_candidates():
    config = {"start_token_id": 1, "end_token_id": 2,
              "prefix_dict": {"1": [5, 2], "1_2": [9], "1_2_9": [5], "1_5": [2]}}
    tree = TreeDFA.from_prefix_dict(config)
    ref = RtpStringTreeDFA(config["prefix_dict"], 1, 2)
    s = tree.step(tree.root, 2)
    ref.next(2)
    assert tree.is_finished(s) and ref.is_finished()
    assert tree.allowed(s) == ref.candidates() == [9]
    assert tree.step(s, 9) == s
    assert tree.stats()["unreachable_keys"] == 1  # "1_2_9" walks past the end token


def test_trie_prefix_leaf_both_ends_and_continues():
    tree = TreeDFA.from_sequences([[5, 6, 7], [5, 6], [8]], end_token_id=0)
    s = tree.walk([5, 6])
    assert tree.allowed(s) == [0, 7]
    leaf = tree.step(s, 7)
    assert tree.allowed(leaf) == [0] and not tree.is_finished(leaf)
    assert tree.is_finished(tree.step(leaf, 0))
    assert tree.allowed(tree.root) == [5, 8]


def test_forced_tokens_is_the_unique_continuation():
    tree = TreeDFA.from_sequences([[5, 6, 7, 9], [5, 6, 7, 10], [11, 12]], end_token_id=0)
    assert tree.forced_tokens(tree.root, 10) == []
    assert tree.forced_tokens(tree.step(tree.root, 5), 10) == [6, 7]
    assert tree.forced_tokens(tree.step(tree.root, 5), 1) == [6]
    assert tree.forced_tokens(tree.step(tree.root, 11), 10) == [12, 0]  # the end token ends it
    assert tree.forced_tokens(tree.finished_state, 10) == []
    assert tree.forced_tokens(tree.error_state, 10) == [0]


def test_beams_fork_by_copying_states(backend):
    tree = TreeDFA.from_sequences([[5, 6], [5, 7], [8]], end_token_id=0, device=backend)
    states = tree.advance(tree.initial_states(2), torch.tensor([5, 8], device=tree.device))
    forked = states[torch.tensor([0, 0, 1], device=tree.device)]  # beam 0 forks in two; beam 1 carries on
    after = tree.advance(forked, torch.tensor([6, 7, 0], device=tree.device))
    expected = [tree.walk([5, 6]), tree.walk([5, 7]), tree.walk([8, 0])]
    assert after.tolist() == expected
    assert states.tolist() == [tree.walk([5]), tree.walk([8])]  # the parents are untouched
    assert tree.finished(after).tolist() == [False, False, True]


def test_dense_rows_cover_wide_nodes_and_padded_bitmasks(backend):
    seqs = [[t, 1] for t in range(3, 200)] + [[3, 4]]
    tree = TreeDFA.from_sequences(seqs, end_token_id=0, vocab_size=300, device=backend, dense_min_width=50)
    stats = tree.stats()
    assert stats["dense_rows"] == 1 and stats["sparse_fill_width"] == 2
    assert stats["dense_bytes"] == 2 * 10 * 4  # a zero row and the root's row, 10 words each
    states = torch.tensor([tree.root, tree.walk([3]), tree.error_state, tree.root], device=tree.device)
    bitmask = torch.full((4, 16), -1, dtype=torch.int32, device=tree.device)  # wider than the vocabulary needs
    tree.fill_bitmask(states, bitmask)
    assert logitgate.token_ids_from_bitmask(bitmask, 512) == [tree.allowed(int(s)) for s in states]
    capped = TreeDFA.from_sequences(seqs, end_token_id=0, vocab_size=300, dense_min_width=50, dense_budget_bytes=39)
    assert capped.stats()["dense_rows"] == 0 and capped.stats()["sparse_fill_width"] == 197


def test_batched_ops_never_sync(monkeypatch):
    """advance / fill_bitmask / candidates only queue tensor ops: no .item(), .tolist(), bool(),
    nonzero() or host copies."""
    tree = TreeDFA.from_sequences([[t, t + 1] for t in range(3, 100)], end_token_id=0, vocab_size=128, dense_min_width=10)
    states = tree.initial_states(4)  # on the tree's device, the default one
    tokens = torch.tensor([3, 1, 0, 99], device=tree.device)
    bitmask = logitgate.allocate_token_bitmask(4, 128, device=tree.device)

    def forbidden(*args, **kwargs):
        raise AssertionError("host sync in a batched tree op")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "nonzero", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    states = tree.advance(states, tokens)
    tree.fill_bitmask(states, bitmask)
    tree.candidates(states)
    tree.finished(states)
    monkeypatch.undo()
    assert states.tolist() == [tree.walk([3]), tree.error_state, tree.finished_state, tree.walk([99])]


def test_out_of_range_tokens_in_advance_go_to_the_error_state():
    tree = TreeDFA.from_sequences([[5]], end_token_id=0)
    out = tree.advance(tree.initial_states(3), torch.tensor([-5, 2**31 + 5, 2**40], device=tree.device))
    assert out.tolist() == [tree.error_state] * 3


def test_max_token_id_counts_the_end_token():
    from logitgate import TreeDFA

    tree = TreeDFA.from_sequences([[3, 9], [4]], end_token_id=20, cache=False)
    assert tree.max_token_id == 20
    tree = TreeDFA.from_sequences([[3, 90], [4]], end_token_id=20, cache=False)
    assert tree.max_token_id == 90
