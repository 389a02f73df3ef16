import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from logitgate.structured import RequestStatus, StructuredOutputManager, StructuredOutputsParams
from logitgate.structured.reasoning import EndMarker
from tests.helpers.vocab_helpers import EOS, THINK_END, THINK_END_ONE, VOCAB_SIZE, plain_rows

ALL = torch.full((10,), -1, dtype=torch.int32)
A, B, C = ord("a"), ord("b"), ord("c")


@given(marker=st.lists(st.integers(0, 2), min_size=1, max_size=4), stream=st.lists(st.integers(0, 2), max_size=14))
def test_end_marker_progress_is_the_longest_marker_prefix_ending_the_stream(marker, stream):
    m = EndMarker(marker)
    progress = 0
    for i, token in enumerate(stream):
        progress = m.step(progress, token)
        seen = stream[: i + 1]
        expected = max(k for k in range(len(marker) + 1) if k == 0 or seen[-k:] == marker[:k])
        assert progress == expected


def test_empty_marker_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        EndMarker([])


@pytest.fixture
def gated(tokenizer_info):
    m = StructuredOutputManager(
        tokenizer_info, vocab_size=VOCAB_SIZE, num_speculative_tokens=6, reasoning_end_token_ids=THINK_END
    )
    yield m
    m.close()


@pytest.fixture(scope="module")
def abc(compiler):
    return compiler.compile_regex("abc")


def add(manager, request_id, **kwargs):
    reasoning_ended = kwargs.pop("reasoning_ended", False)
    manager.add_request(request_id, StructuredOutputsParams(**kwargs), reasoning_ended=reasoning_ended)
    assert manager.wait(request_id, timeout=30) is RequestStatus.READY


def test_rows_allow_everything_until_the_marker_then_constrain(gated, abc):
    add(gated, "r", regex="abc")
    assert torch.equal(gated.grammar_bitmask(["r"])[0], ALL)
    assert not gated.reasoning_ended("r")
    # Free text (even tokens the grammar forbids), a false start "</" "</", then the marker and "a".
    thinking = [ord("z"), THINK_END[0], THINK_END[0], THINK_END[1], THINK_END[2]]
    assert gated.accept_tokens("r", thinking + [A])
    assert gated.reasoning_ended("r")
    assert torch.equal(gated.grammar_bitmask(["r"]), plain_rows(abc, [[A]]))
    assert not gated.accept_tokens("r", [ord("z")])  # constrained now


def test_marker_split_across_steps_and_rejection_keeps_reasoning_state(gated, abc):
    add(gated, "r", regex="abc")
    assert gated.accept_tokens("r", THINK_END[:2])
    assert not gated.reasoning_ended("r")
    assert not gated.accept_tokens("r", [THINK_END[2], ord("z")])  # marker then a bad token: all refused
    assert not gated.reasoning_ended("r")
    assert gated.validate_tokens("r", [THINK_END[2], A, ord("z")]) == [THINK_END[2], A]
    assert gated.accept_tokens("r", [THINK_END[2]])
    assert torch.equal(gated.grammar_bitmask(["r"]), plain_rows(abc, [[]]))


def test_a_marker_inside_the_draft_window_constrains_the_positions_after_it(gated, abc):
    add(gated, "r", regex="abc")
    drafts = [ord("q"), *THINK_END, A, B]
    bitmask = gated.grammar_bitmask(["r"], {"r": drafts})
    assert bitmask.shape == (7, 10)
    for k in range(4):  # after q, </, think: still reasoning
        assert torch.equal(bitmask[k], ALL), k
    assert torch.equal(bitmask[4:], plain_rows(abc, [[], [A], [A, B]]))
    assert not gated.reasoning_ended("r")  # grammar_bitmask changed nothing
    assert torch.equal(gated.grammar_bitmask(["r"])[0], ALL)
    # A rejected draft after the marker: later rows repeat the last valid one.
    rejected = gated.grammar_bitmask(["r"], {"r": [*THINK_END, ord("z"), A]})
    assert torch.equal(rejected[3], plain_rows(abc, [[]])[0])
    assert torch.equal(rejected[4], rejected[3]) and torch.equal(rejected[5], rejected[3])


def test_enable_in_reasoning_manager_wide_and_per_request(tokenizer_info, abc):
    with StructuredOutputManager(
        tokenizer_info, vocab_size=VOCAB_SIZE, reasoning_end_token_ids=[THINK_END_ONE], enable_in_reasoning=True
    ) as m:
        add(m, "on", regex="abc")
        add(m, "off", regex="abc", enable_in_reasoning=False)
        bitmask = m.grammar_bitmask(["on", "off"])
        assert torch.equal(bitmask[0], plain_rows(abc, [[]])[0])
        assert torch.equal(bitmask[1], ALL)
        assert m.accept_tokens("off", [ord("z"), THINK_END_ONE, A])
        assert torch.equal(m.grammar_bitmask(["off"]), plain_rows(abc, [[A]]))


def test_prompt_that_already_ended_reasoning(gated, abc):
    add(gated, "r", regex="abc", reasoning_ended=True)
    assert gated.reasoning_ended("r")
    assert torch.equal(gated.grammar_bitmask(["r"]), plain_rows(abc, [[]]))


def test_rollback_across_the_marker_restores_reasoning(gated, abc):
    add(gated, "r", regex="abc")
    assert gated.accept_tokens("r", [ord("x"), *THINK_END, A, B])
    gated.rollback("r", 2)
    assert gated.reasoning_ended("r")
    assert torch.equal(gated.grammar_bitmask(["r"]), plain_rows(abc, [[]]))
    gated.rollback("r", 1)  # un-emit the marker's last token
    assert not gated.reasoning_ended("r")
    assert torch.equal(gated.grammar_bitmask(["r"])[0], ALL)
    assert gated.accept_tokens("r", [THINK_END[2], A, B, C, EOS])
    assert gated.is_terminated("r")
    with pytest.raises(ValueError, match="only 8 were accepted"):
        gated.rollback("r", 9)


def test_drafts_are_validated_through_the_reasoning_span(gated):
    add(gated, "r", regex="abc")
    out = gated.validate_draft_tokens({"r": [ord("z"), *THINK_END, A, ord("z")]})
    assert out == {"r": [ord("z"), *THINK_END, A, -1]}
    assert not gated.is_terminated("r")
