"""The tree grammar backend on logitgate's TreeDFA (structured/tree/dfa.py). Skipped until TreeDFA is
merged; everything here goes through TreeDFA's documented API only."""
import json

import pytest
import torch

import logitgate
from logitgate.structured import RequestStatus, StructuredOutputManager, StructuredOutputsParams
from tests.helpers.vocab_helpers import EOS, PERSON_SCHEMA, VOCAB_SIZE, encode, plain_rows

TreeDFA = getattr(logitgate, "TreeDFA", None)
if TreeDFA is None:
    pytest.skip("logitgate.TreeDFA is not available yet", allow_module_level=True)

from logitgate.structured.tree.grammar_backend import TreeBackend  # noqa: E402

ALL = torch.full((10,), -1, dtype=torch.int32)
START = 5
CONFIG = {
    "start_token_id": START,
    "end_token_id": EOS,
    "sep": "_",
    "prefix_dict": {"5": [10, 11], "5_10": [12], "5_11": [13, 14]},
}
PAYLOAD = {
    "modelId": "offline-test",
    "descriptors": [{"path": "action", "leaves": [
        {"name": "A", "tokens": [20, 21]}, {"name": "B", "tokens": [20, 22]}, {"name": "C", "tokens": [23]}]}],
}


def row_of(tokens):
    return logitgate.bitmask_from_token_ids([tokens], VOCAB_SIZE)[0]


def tree_rows(tree, prefixes):
    """Reference rows from TreeDFA's own scalar API."""
    rows = []
    for prefix in prefixes:
        state = tree.root
        for t in prefix:
            state = tree.step(state, t)
        rows.append(row_of(tree.allowed(state)))
    return torch.stack(rows)


@pytest.fixture
def manager(tokenizer_info):
    m = StructuredOutputManager(tokenizer_info, vocab_size=VOCAB_SIZE, num_speculative_tokens=4)
    yield m
    m.close()


def add(manager, request_id, **constraint):
    manager.add_request(request_id, StructuredOutputsParams(**constraint))
    assert manager.wait(request_id, timeout=30) is RequestStatus.READY, manager.error(request_id)


def test_prefix_dict_rows_follow_the_tree(manager):
    add(manager, "t", prefix_dict=CONFIG)
    tree = TreeDFA.from_prefix_dict(CONFIG, vocab_size=VOCAB_SIZE)
    assert torch.equal(manager.grammar_bitmask(["t"])[0], row_of([10, 11]))  # prefix_dict["5"]
    bitmask = manager.grammar_bitmask(["t"], {"t": [11, 13, EOS]})
    assert torch.equal(bitmask[:3], tree_rows(tree, [[], [11], [11, 13]]))
    assert torch.equal(bitmask[3], ALL)  # finished: everything allowed, as for xgrammar
    assert torch.equal(manager.grammar_bitmask(["t"])[0], row_of([10, 11]))  # state unchanged


def test_rejected_tree_draft_repeats_the_last_valid_row(manager):
    add(manager, "t", prefix_dict=json.dumps(CONFIG))
    bitmask = manager.grammar_bitmask(["t"], {"t": [10, 13, 12, EOS]})
    assert torch.equal(bitmask[1], row_of([12]))
    for k in (2, 3, 4):
        assert torch.equal(bitmask[k], bitmask[1])


def test_accept_validate_rollback_terminate(manager):
    add(manager, "t", prefix_dict=CONFIG)
    assert manager.validate_tokens("t", [10, 12, EOS, 10]) == [10, 12, EOS]
    assert manager.validate_tokens("t", [11, 12]) == [11]
    assert not manager.accept_tokens("t", [10, 13])
    assert manager.accept_tokens("t", [10])
    manager.rollback("t", 1)
    assert manager.accept_tokens("t", [11, 14])
    assert not manager.is_terminated("t")
    assert manager.accept_tokens("t", [EOS]) and manager.is_terminated("t")
    assert not manager.accept_tokens("t", [EOS])


def test_token_trie_end_token_from_payload_or_tokenizer(tokenizer_info):
    tree = TreeDFA.from_token_trie(json.dumps(PAYLOAD), end_token_id=EOS, vocab_size=VOCAB_SIZE)
    with StructuredOutputManager(tokenizer_info, vocab_size=VOCAB_SIZE, num_speculative_tokens=2) as m:
        add(m, "default-end", token_trie=PAYLOAD)
        add(m, "explicit-end", token_trie={**PAYLOAD, "end_token_id": EOS})
        bitmask = m.grammar_bitmask(["default-end", "explicit-end"], {"default-end": [20, 21], "explicit-end": [23]})
        assert torch.equal(bitmask[0], row_of([20, 23]))
        assert torch.equal(bitmask[:3], tree_rows(tree, [[], [20], [20, 21]]))
        assert torch.equal(bitmask[3:5], tree_rows(tree, [[], [23]]))
    with StructuredOutputManager(vocab_size=VOCAB_SIZE) as m:  # no tokenizer: no default end token
        m.add_request("t", StructuredOutputsParams(token_trie=PAYLOAD))
        assert m.wait("t", timeout=30) is RequestStatus.FAILED
        assert "needs an end token" in m.error("t")
        add(m, "p", prefix_dict=CONFIG)  # prefix dicts carry their own end token


def test_mixed_tree_and_xgrammar_batch(manager, compiler):
    add(manager, "json", json=PERSON_SCHEMA)
    add(manager, "tree", prefix_dict=CONFIG)
    add(manager, "tree2", prefix_dict=CONFIG)
    text = encode('{"name"')
    spec = {"json": text[:2], "tree": [10, 12], "tree2": [11]}
    bitmask = manager.grammar_bitmask(["tree", "json", "tree2"], spec)
    tree = TreeDFA.from_prefix_dict(CONFIG, vocab_size=VOCAB_SIZE)
    assert torch.equal(bitmask[0:3], tree_rows(tree, [[], [10], [10, 12]]))
    assert torch.equal(bitmask[3:6], plain_rows(compiler.compile_json_schema(PERSON_SCHEMA), [[], text[:1], text[:2]]))
    assert torch.equal(bitmask[6:8], tree_rows(tree, [[], [11]]))


def test_backend_batched_fill_equals_single_rows(tokenizer_info):
    backend = TreeBackend(tokenizer_info, vocab_size=VOCAB_SIZE)
    grammars = [backend.compile("prefix_dict", CONFIG) for _ in range(3)]
    for g, prefix in zip(grammars, [[], [10], [11, 13]]):
        assert g.accept_tokens(prefix)
    batched, single = backend.allocate_token_bitmask(4), backend.allocate_token_bitmask(4)
    backend.fill_bitmasks(grammars, batched, [3, 0, 1])
    for g, r in zip(grammars, [3, 0, 1]):
        g.fill_bitmask(single, r)
    assert torch.equal(batched, single) and torch.equal(batched[2], ALL)
    assert grammars[2].fresh().num_accepted_tokens == 0
    with pytest.raises(ValueError, match="only 2 were accepted"):
        grammars[2].rollback(3)


def test_tree_grammar_fork_is_an_independent_copy():
    backend = TreeBackend(vocab_size=VOCAB_SIZE)
    g = backend.compile("prefix_dict", CONFIG)
    assert g.accept_tokens([11])
    twin = g.fork()
    assert twin.accept_tokens([13]) and g.accept_tokens([14])
    assert g.num_accepted_tokens == twin.num_accepted_tokens == 2
    twin.rollback(2)
    assert twin.validate_tokens([10, 12, EOS]) == [10, 12, EOS] and g.validate_tokens([EOS]) == [EOS]
