"""The Tree logits processor: trees from extra_args, errors that name the key and row and leave the
state untouched, output lists read by reference (async-scheduling placeholders, dropped tokens),
batched masking (one fill per distinct tree), speculative decoding, and the sampler pipeline."""
import json

import pytest
import torch

from logitgate import TreeDFA
from logitgate.sampling import Sampler, SamplingMetadata, SamplingParams
from logitgate.sampling.processors import BatchUpdateBuilder, LogitsProcessors, MoveDirectionality, Tree

V = 64
EOS = 1
CONFIG = {"start_token_id": 60, "end_token_id": EOS, "prefix_dict": {"60": [10, 11], "60_10": [12, 13], "60_10_12": [EOS]}}
TRIE = {"modelId": "m", "descriptors": [{"path": "act", "leaves": [{"name": "a", "tokens": [20, 21]}, {"name": "b", "tokens": [22]}]}]}
NEG_INF = float("-inf")


def allowed(row):
    return torch.nonzero(row > NEG_INF).flatten().tolist()


def tree_params(**extra):
    return SamplingParams(extra_args=extra)


def added(processor, requests, batch_size=None):
    """requests: {row: (params, output list)}."""
    builder = BatchUpdateBuilder()
    for index, (params, output) in requests.items():
        builder.add(index, params, None, output)
    processor.update_state(builder.get_and_reset(batch_size or len(requests)))


def test_each_row_follows_its_own_tree_and_other_rows_are_untouched():
    proc = Tree(V, eos_token_id=EOS)
    outs = [[], [], []]
    added(proc, {0: (tree_params(tree_decode=CONFIG), outs[0]), 1: (SamplingParams(), outs[1]),
                 2: (tree_params(token_trie=TRIE), outs[2])})  # the trie ends with the processor's EOS
    logits = torch.randn(3, V)
    got = proc.apply(logits.clone())
    assert allowed(got[0]) == [10, 11] and allowed(got[2]) == [20, 22]
    assert torch.equal(got[1], logits[1])
    assert torch.equal(got[0, [10, 11]], logits[0, [10, 11]])  # allowed logits keep their values
    outs[0].append(10)
    outs[2] += [20, 21]
    got = proc.apply(torch.randn(3, V))
    assert allowed(got[0]) == [12, 13] and allowed(got[2]) == [EOS]
    assert proc.state(1) is None and not proc.is_argmax_invariant()


def test_rows_follow_swaps_and_moves():
    proc = Tree(V)
    a, b = [10], []
    added(proc, {0: (tree_params(tree_decode=CONFIG), a), 1: (tree_params(tree_decode=CONFIG), b)})
    builder = BatchUpdateBuilder()
    builder.move(0, 1, MoveDirectionality.SWAP)
    proc.update_state(builder.get_and_reset(2))
    got = proc.apply(torch.zeros(2, V))
    assert allowed(got[0]) == [10, 11] and allowed(got[1]) == [12, 13]
    builder.removed_append(0)
    builder.move(1, 0, MoveDirectionality.UNIDIRECTIONAL)
    proc.update_state(builder.get_and_reset(1))
    assert allowed(proc.apply(torch.zeros(1, V))[0]) == [12, 13]


def test_async_placeholders_are_read_once_filled_and_dropped_tokens_are_replayed():
    proc = Tree(V)
    out = []
    added(proc, {0: (tree_params(tree_decode=CONFIG), out)})
    out.append(-1)  # vLLM's async scheduling: the token sampled last step is not on the host yet
    proc.update_state(None)
    out[-1] = 10  # filled just before sampling
    assert allowed(proc.apply(torch.zeros(1, V))[0]) == [12, 13]
    out.append(12)
    assert proc.state(0) == TreeDFA.from_prefix_dict(CONFIG, vocab_size=V, device="cpu").walk([10, 12])
    del out[1:]  # the engine discarded a token (a failed KV load): the walk is replayed
    assert allowed(proc.apply(torch.zeros(1, V))[0]) == [12, 13]


def test_a_resumed_request_catches_up_with_its_output():
    proc = Tree(V)
    added(proc, {0: (tree_params(tree_decode=CONFIG), [10, 12])})
    assert allowed(proc.apply(torch.zeros(1, V))[0]) == [EOS]


def test_unknown_token_and_end_token_follow_rtp_semantics():
    proc = Tree(V)
    out = [33]  # not a candidate: the error state allows only the end token
    added(proc, {0: (tree_params(tree_decode=CONFIG), out)})
    assert allowed(proc.apply(torch.zeros(1, V))[0]) == [EOS]
    out.append(EOS)
    assert allowed(proc.apply(torch.zeros(1, V))[0]) == [EOS]


def test_requests_with_equal_trees_share_one_compiled_tree_and_one_fill(monkeypatch):
    proc = Tree(V)
    p1 = tree_params(tree_decode=CONFIG)
    p2 = tree_params(tree_decode=json.loads(json.dumps(CONFIG)))  # an equal copy
    assert proc.tree_for(p1) is proc.tree_for(p2)
    calls = []
    import logitgate.sampling.processors.tree as tree_module

    original = tree_module.keep_only_allowed
    monkeypatch.setattr(
        tree_module, "keep_only_allowed", lambda tree, logits, states, *a, **k: calls.append(len(states)) or original(tree, logits, states, *a, **k)
    )
    added(proc, {0: (p1, []), 1: (SamplingParams(), []), 2: (p2, [10]), 3: (tree_params(token_trie=TRIE, end_token_id=EOS), [])})
    got = proc.apply(torch.zeros(4, V))
    assert sorted(calls) == [1, 2]  # one masking call per distinct tree, all its rows at once
    assert [allowed(got[r]) for r in (0, 2, 3)] == [[10, 11], [12, 13], [20, 22]]


def test_tree_from_a_path_and_a_json_string(tmp_path):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(CONFIG))
    proc = Tree(V)
    added(proc, {0: (tree_params(tree_decode=str(path)), []), 1: (tree_params(tree_decode=json.dumps(CONFIG)), [])})
    got = proc.apply(torch.zeros(2, V))
    assert allowed(got[0]) == allowed(got[1]) == [10, 11]


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"tree_decode": CONFIG, "token_trie": TRIE}, "both 'tree_decode' and 'token_trie'"),
        ({"tree_decode": [1, 2]}, "extra_args['tree_decode'] must be a dict, a JSON string or a path, got list"),
        ({"end_token_id": EOS}, "extra_args['end_token_id'] applies to 'token_trie', which is not given"),
        ({"tree_decode": CONFIG, "token_trie_path": "act"}, "'token_trie_path'] applies to 'token_trie', not to 'tree_decode'"),
        ({"token_trie": TRIE}, "needs extra_args['end_token_id']"),
        ({"token_trie": TRIE, "end_token_id": -3}, "end_token_id"),
        ({"token_trie": TRIE, "end_token_id": V}, f"extra_args['end_token_id'] {V} is >= vocab_size {V}"),
        ({"token_trie": TRIE, "end_token_id": EOS, "token_trie_path": 3}, "'token_trie_path'] must be a string"),
        ({"token_trie": TRIE, "end_token_id": EOS, "token_trie_model_id": "other"}, "for model 'm', not 'other'"),
        ({"tree_decode": {"end_token_id": EOS, "prefix_dict": {}}}, "start_token_id"),
        ({"tree_decode": {**CONFIG, "prefix_dict": {"60": [10, V + 5]}}}, str(V + 5)),
        ({"tree_decode": '{"start_token_id": 1,'}, "not valid JSON"),
        ({"tree_decode": "/nonexistent/tree.json"}, "does not exist"),
    ],
)
def test_validate_params_names_the_problem(extra, message):
    with pytest.raises(ValueError, match="extra_args") as err:
        Tree(V).validate_params(tree_params(**extra))
    assert message in str(err.value)


def test_a_bad_request_fails_its_batch_update_and_leaves_state_untouched():
    proc = Tree(V)
    out = [10]
    added(proc, {0: (tree_params(tree_decode=CONFIG), out)})
    builder = BatchUpdateBuilder()
    builder.add(1, tree_params(tree_decode=CONFIG), None, [])
    builder.add(2, tree_params(token_trie=TRIE), None, [])  # no end token
    builder.move(0, 3, MoveDirectionality.UNIDIRECTIONAL)
    with pytest.raises(ValueError, match="request added at row 2: extra_args\\['token_trie'\\]"):
        proc.update_state(builder.get_and_reset(4))
    got = proc.apply(torch.zeros(3, V))  # row 0 still there, nothing was added or moved
    assert allowed(got[0]) == [12, 13] and allowed(got[1]) == allowed(got[2]) == list(range(V))


def test_spec_decode_masks_each_draft_position_with_the_state_after_the_earlier_drafts():
    proc = Tree(V)
    added(proc, {0: (tree_params(tree_decode=CONFIG), []), 1: (SamplingParams(), []), 2: (tree_params(tree_decode=CONFIG), [10])})
    logits = torch.randn(2 + 1 + 3, V)
    got = proc.apply_with_spec_decode(logits.clone(), [1, 0, 2], [[10], [], [-1, 12]])
    assert allowed(got[0]) == [10, 11] and allowed(got[1]) == [12, 13]  # request 0: before / after draft 10
    assert torch.equal(got[2], logits[2])  # request 1 has no tree
    assert allowed(got[3]) == [12, 13]
    assert allowed(got[4]) == allowed(got[5]) == [EOS]  # after a placeholder draft: never reached, the error state
    with pytest.raises(ValueError, match="Tree needs draft_token_ids"):
        proc.apply_with_spec_decode(logits.clone(), [1, 0, 2])


def test_in_the_sampler_greedy_and_random_rows_stay_on_the_tree(backend):
    torch.manual_seed(0)
    params = [SamplingParams(temperature=0.0, extra_args={"tree_decode": CONFIG}),
              SamplingParams(temperature=1.0, seed=3, extra_args={"tree_decode": CONFIG}),
              SamplingParams(temperature=0.0)]
    procs = LogitsProcessors([Tree(V, backend.device)])
    builder = BatchUpdateBuilder()
    outs = [[], [], []]
    for i, p in enumerate(params):
        builder.add(i, p, None, outs[i])
    procs.update_state(builder.get_and_reset(3))
    sampler = Sampler(backend=backend)
    for _ in range(4):
        logits = (torch.randn(3, V) * 3).to(backend.device)
        metadata = SamplingMetadata.from_params(params, device=backend.device, logitsprocs=procs)
        tokens = sampler(logits, metadata).sampled_token_ids.flatten().tolist()
        for out, token in zip(outs, tokens):
            out.append(token)
        procs.update_state(None)
    tree = TreeDFA.from_prefix_dict(CONFIG, vocab_size=V, device="cpu")
    for out in outs[:2]:
        state = tree.root
        for token in out:
            assert token in tree.allowed(state)
            state = tree.step(state, token)
        assert out[:3] in ([10, 12, EOS], [10, 13, EOS], [11, EOS, EOS])
