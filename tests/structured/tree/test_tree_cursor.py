"""TreeCursor, the one cursor every route uses: decided tokens are committed (RTP-LLM: an unknown
token leads to the error state), proposed tokens are accepted all or nothing, rollback / reset /
fork, and following an engine's output list (placeholders, replay after the list shrinks)."""
import pytest

from logitgate import TreeDFA
from logitgate.structured.constraint_state import GrammarConstraint, TreeConstraint
from logitgate.structured.tree.cursor import TreeCursor
from logitgate.structured.tree.grammar_backend import TreeGrammar

TREE = TreeDFA.from_sequences([[5, 6], [5, 7], [9]], end_token_id=0, vocab_size=32, cache=False)


def test_decided_tokens_always_move_and_proposed_ones_only_when_allowed():
    cursor = TreeCursor(TREE)
    assert cursor.walk_states([5, 6, 0]) == [TREE.root, TREE.walk([5]), TREE.walk([5, 6]), TREE.finished_state]
    assert cursor.walk_states([5, 99], vocab_size=32) == [TREE.root, TREE.walk([5]), TREE.error_state]
    assert cursor.accepted_prefix([5, 8, 6]) == [5] and cursor.valid_prefix([5, 8]) == 1 and cursor.num_tokens == 0
    assert not cursor.accept([5, 8]) and cursor.num_tokens == 0  # all or nothing
    assert cursor.accept([5, 6]) and cursor.state == TREE.walk([5, 6])
    cursor.commit([3])  # not allowed: the error state, whose only token is the end token
    assert cursor.state == TREE.error_state and cursor.end_of([0]) == 1 and not cursor.is_terminated()
    cursor.rollback(1)
    assert cursor.state == TREE.walk([5, 6]) and cursor.forced_tokens(4) == [0]
    assert cursor.accept([0]) and cursor.is_terminated() and cursor.accepted_prefix([0]) == []  # nothing after the end
    assert cursor.valid_prefix([0]) == 1  # the decode loop's draft check: a finished state allows its end token
    with pytest.raises(ValueError, match="cannot roll back 5 tokens: only 3"):
        cursor.rollback(5)
    twin = cursor.fork()
    twin.reset()
    assert twin.state == TREE.root and cursor.is_terminated() and type(twin) is TreeCursor


def test_following_an_output_list_reads_final_tokens_and_replays_a_shorter_one():
    output = [5, -1]  # -1: an async-scheduling placeholder
    cursor = TreeCursor(TREE)
    cursor.follow(output)
    assert cursor.num_tokens == 1 and cursor.state == TREE.walk([5])
    output[1:] = [7, 0]
    cursor.follow(output)
    assert cursor.num_tokens == 3 and cursor.is_terminated()
    output[:] = [9]  # the engine dropped tokens: replayed from the root
    cursor.follow(output)
    assert cursor.num_tokens == 1 and cursor.state == TREE.walk([9])
    reads = []
    cursor.catch_up(3, lambda a, b: reads.append((a, b)) or [0, 0][: b - a])
    assert reads == [(1, 3)] and cursor.is_terminated()


def test_every_route_moves_with_tree_cursor():
    grammar, constraint = TreeGrammar(TREE), TreeConstraint(TREE)
    assert isinstance(grammar, TreeCursor) and isinstance(constraint, TreeCursor)
    assert grammar.accept_tokens([5]) and grammar.validate_tokens([6, 6]) == [6] and grammar.num_accepted_tokens == 1
    assert isinstance(grammar.fork(), TreeGrammar) and grammar.fresh().num_tokens == 0
    constraint.commit([3])  # the decode loop commits decided tokens (RTP-LLM semantics)
    assert constraint.state == TREE.error_state and isinstance(constraint.fork(), TreeConstraint)


def test_one_name_one_meaning():
    """No subclass gives a cursor's method another meaning: accept is all or nothing everywhere,
    commit takes decided tokens everywhere, and the decode loop's two constraints share commit."""
    for cls in (TreeGrammar, TreeConstraint):
        assert all(getattr(cls, name) is getattr(TreeCursor, name) for name in ("accept", "commit", "accepted_prefix", "valid_prefix"))
    assert not hasattr(TreeCursor, "advance")  # TreeDFA.advance is the batch step (tensors)
    assert not hasattr(TreeCursor, "validate")  # accepted_prefix (what accept would take) vs valid_prefix (allowed)
    assert callable(GrammarConstraint.commit) and not hasattr(GrammarConstraint, "accept")
    constraint = TreeConstraint(TREE)
    assert not constraint.accept([5, 8]) and constraint.num_tokens == 0  # the cursor's accept, unchanged
