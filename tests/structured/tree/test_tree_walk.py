"""TreeWalk, the one walk every route uses: decided tokens advance (RTP-LLM: an unknown token leads
to the error state), proposed tokens are accepted all or nothing, rollback / reset / fork, and
following an engine's output list (placeholders, replay after the list shrinks)."""
import pytest

from logitgate import TreeDFA
from logitgate.structured.constraint_state import TreeConstraint
from logitgate.structured.tree.grammar_backend import TreeGrammar
from logitgate.structured.tree.walk import TreeWalk

TREE = TreeDFA.from_sequences([[5, 6], [5, 7], [9]], end_token_id=0, vocab_size=32, cache=False)


def test_decided_tokens_always_move_and_proposed_ones_only_when_allowed():
    walk = TreeWalk(TREE)
    assert walk.walk_states([5, 6, 0]) == [TREE.root, TREE.walk([5]), TREE.walk([5, 6]), TREE.finished_state]
    assert walk.walk_states([5, 99], vocab_size=32) == [TREE.root, TREE.walk([5]), TREE.error_state]
    assert walk.validate([5, 8, 6]) == [5] and walk.valid_prefix([5, 8]) == 1 and walk.num_tokens == 0
    assert not walk.accept([5, 8]) and walk.num_tokens == 0  # all or nothing
    assert walk.accept([5, 6]) and walk.state == TREE.walk([5, 6])
    walk.advance([3])  # not allowed: the error state, whose only token is the end token
    assert walk.state == TREE.error_state and walk.end_of([0]) == 1 and not walk.is_terminated()
    walk.rollback(1)
    assert walk.state == TREE.walk([5, 6]) and walk.forced_tokens(4) == [0]
    assert walk.accept([0]) and walk.is_terminated() and walk.validate([0]) == []  # nothing after the end
    assert walk.valid_prefix([0]) == 1  # the decode loop's draft check: a finished state allows its end token
    with pytest.raises(ValueError, match="cannot roll back 5 tokens: only 3"):
        walk.rollback(5)
    twin = walk.fork()
    twin.reset()
    assert twin.state == TREE.root and walk.is_terminated() and type(twin) is TreeWalk


def test_following_an_output_list_reads_final_tokens_and_replays_a_shorter_one():
    output = [5, -1]  # -1: an async-scheduling placeholder
    walk = TreeWalk(TREE)
    walk.follow(output)
    assert walk.num_tokens == 1 and walk.state == TREE.walk([5])
    output[1:] = [7, 0]
    walk.follow(output)
    assert walk.num_tokens == 3 and walk.is_terminated()
    output[:] = [9]  # the engine dropped tokens: replayed from the root
    walk.follow(output)
    assert walk.num_tokens == 1 and walk.state == TREE.walk([9])
    reads = []
    walk.catch_up(3, lambda a, b: reads.append((a, b)) or [0, 0][: b - a])
    assert reads == [(1, 3)] and walk.is_terminated()


def test_every_route_walks_with_tree_walk():
    grammar, constraint = TreeGrammar(TREE), TreeConstraint(TREE)
    assert isinstance(grammar, TreeWalk) and isinstance(constraint, TreeWalk)
    assert grammar.accept_tokens([5]) and grammar.validate_tokens([6, 6]) == [6] and grammar.num_accepted_tokens == 1
    assert isinstance(grammar.fork(), TreeGrammar) and grammar.fresh().num_tokens == 0
    constraint.accept([3])  # the decode loop's accept takes decided tokens (RTP-LLM semantics)
    assert constraint.state == TREE.error_state and isinstance(constraint.fork(), TreeConstraint)
