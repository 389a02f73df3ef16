"""Logits processors: the batch-update protocol, the built-ins' behaviour, ThinkMode's phases,
speculative decoding, and errors that leave state untouched."""
import pytest
import torch

from logitgate.sampling import SamplingParams
from logitgate.sampling.processors import (
    BatchUpdate,
    BatchUpdateBuilder,
    LogitBias,
    LogitsProcessor,
    LogitsProcessors,
    MinP,
    MinTokens,
    MoveDirectionality,
    MultiSeq,
    ThinkMode,
    builtin_logits_processors,
)

V = 16
NEG_INF = float("-inf")


def add_all(processor, requests):
    """requests: list of (params, prompt, output) placed at rows 0..n-1."""
    builder = BatchUpdateBuilder()
    for index, (params, prompt, output) in enumerate(requests):
        builder.add(index, params, prompt, output)
    processor.update_state(builder.get_and_reset(len(requests)))


def allowed(logits_row):
    return torch.nonzero(logits_row > NEG_INF).flatten().tolist()


# ---- BatchUpdateBuilder ----


def test_builder_reuses_the_lowest_freed_row_and_reports_the_rest():
    builder = BatchUpdateBuilder()
    for index in (5, 2, 7):
        builder.removed_append(index)
    assert builder.peek_removed() == 2
    assert builder.pop_removed() == 2
    with pytest.raises(RuntimeError, match="after this step's removals were read"):
        builder.removed_append(1)
    builder.add(2, SamplingParams(), [1], [])
    builder.move(9, 5, MoveDirectionality.UNIDIRECTIONAL)
    update = builder.get_and_reset(8)
    assert isinstance(update, BatchUpdate)
    assert update.batch_size == 8 and list(update.removed) == [7, 5] and update.moved == [(9, 5, MoveDirectionality.UNIDIRECTIONAL)]
    assert [a[0] for a in update.added] == [2]
    assert builder.get_and_reset(8) is None  # nothing changed since
    builder.removed_append(1)  # a new step accepts removals again
    assert builder.reset() is True


def test_builder_validates_its_input():
    builder = BatchUpdateBuilder()
    with pytest.raises(ValueError, match="output_ids of the request added at 0 must be a list"):
        builder.add(0, SamplingParams(), None, (1, 2))
    with pytest.raises(ValueError, match="move index b"):
        builder.move(1, -1)
    with pytest.raises(ValueError, match="directionality"):
        builder.move(1, 2, "swap")


def test_collection_splits_by_argmax_invariance():
    procs = LogitsProcessors(builtin_logits_processors(V, eos_token_id=0))
    assert [type(p).__name__ for p in procs.argmax_invariant] == ["MinP"]
    assert [type(p).__name__ for p in procs.non_argmax_invariant] == ["LogitBias", "MinTokens"]
    assert len(procs) == 3 and list(procs) == procs.all
    with pytest.raises(ValueError, match="str is not a LogitsProcessor"):
        LogitsProcessors(["MinP"])


def test_a_bad_request_changes_no_state():
    procs = LogitsProcessors(builtin_logits_processors(V, eos_token_id=0))
    add_all(procs, [(SamplingParams(logit_bias={3: 2.0}), None, [])])
    builder = BatchUpdateBuilder()
    builder.add(1, SamplingParams(logit_bias={99: 1.0}), None, [])
    builder.add(2, SamplingParams(min_p=0.5), None, [])
    with pytest.raises(ValueError, match="request added at row 1: logit_bias has token id 99"):
        procs.update_state(builder.get_and_reset(3))
    logits = procs.all[0].apply(torch.zeros(1, V))  # LogitBias still holds only row 0's bias
    assert logits[0, 3] == 2.0 and logits.sum() == 2.0
    assert procs.argmax_invariant[0].apply(torch.zeros(1, V)).eq(0).all()  # MinP never saw row 2


# ---- built-ins ----


def test_min_p_follows_moves_and_swaps():
    proc = MinP()
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]] * 3))
    add_all(proc, [(SamplingParams(min_p=0.6), None, []), (SamplingParams(), None, []), (SamplingParams(min_p=0.2), None, [])])
    assert [len(allowed(r)) for r in proc.apply(logits.clone())] == [1, 3, 2]
    builder = BatchUpdateBuilder()
    builder.move(0, 1, MoveDirectionality.SWAP)
    proc.update_state(builder.get_and_reset(3))
    assert [len(allowed(r)) for r in proc.apply(logits.clone())] == [3, 1, 2]
    builder.removed_append(1)
    builder.move(2, 1, MoveDirectionality.UNIDIRECTIONAL)
    proc.update_state(builder.get_and_reset(2))
    assert [len(allowed(r)) for r in proc.apply(logits[:2].clone())] == [3, 2]


def test_logit_bias_adds_per_row():
    proc = LogitBias(V)
    add_all(proc, [(SamplingParams(logit_bias={1: 1.5, 4: -2.0}), None, []), (SamplingParams(), None, [])])
    out = proc.apply(torch.zeros(2, V))
    assert out[0, 1] == 1.5 and out[0, 4] == -2.0 and out[1].eq(0).all()


def test_min_tokens_masks_stops_until_reached():
    proc = MinTokens(V, eos_token_id=0)
    output = []
    add_all(proc, [(SamplingParams(min_tokens=2, stop_token_ids=[5]), None, output), (SamplingParams(min_tokens=2, ignore_eos=True), None, [])])
    out = proc.apply(torch.zeros(2, V))
    assert set(range(V)) - set(allowed(out[0])) == {0, 5}
    assert allowed(out[1]) == list(range(V))  # ignore_eos and no stop tokens: nothing to mask
    output.extend([7, 8])
    proc.update_state(None)
    assert allowed(proc.apply(torch.zeros(2, V))[0]) == list(range(V))


def test_multiseq_pads_finished_rows_with_eos():
    proc = MultiSeq(V, eos_token_id=0)
    a, b = [], []
    add_all(proc, [(SamplingParams(stop_token_ids=[9]), None, a), (SamplingParams(ignore_eos=True), None, b)])
    assert allowed(proc.apply(torch.zeros(2, V))[0]) == list(range(V))
    a.append(9)  # a stop token finishes the sequence
    b.append(0)  # EOS does not finish an ignore_eos request
    proc.update_state(None)
    out = proc.apply(torch.randn(2, V))
    assert allowed(out[0]) == [0] and out[0, 0] == 0.0
    assert allowed(out[1]) == list(range(V))
    with pytest.raises(ValueError, match="eos_token_id 16 is outside the vocabulary"):
        MultiSeq(V, eos_token_id=16)


# ---- ThinkMode ----

BEGIN, END = 2, 4
END_SEQ = [3, 4, 5]  # e.g. "\n</think>\n\n": END marks the end of thinking


def think(budget, prompt, output):
    proc = ThinkMode(V, end_think_token_ids=END_SEQ, end_think_token_id=END, begin_think_token_id=BEGIN)
    add_all(proc, [(SamplingParams(max_thinking_tokens=budget), prompt, output)])
    return proc


def step(proc, output, token):
    output.append(token)
    proc.update_state(None)
    return allowed(proc.apply(torch.zeros(1, V))[0])


def test_thinkmode_forces_the_end_sequence_when_the_budget_is_spent():
    output = []
    proc = think(2, [10, 11], output)
    assert proc.phase(0) == "before"
    assert END not in allowed(proc.apply(torch.zeros(1, V))[0])  # no end before a beginning
    assert BEGIN not in step(proc, output, BEGIN)  # thinking: no second beginning
    assert proc.phase(0) == "thinking"
    assert len(step(proc, output, 9)) == V - 1
    assert step(proc, output, 8) == [3]  # budget of 2 spent: force the sequence
    assert step(proc, output, 3) == [4]
    assert step(proc, output, 4) == [5]  # the forced sequence runs to its end
    after = step(proc, output, 5)
    assert proc.phase(0) == "after" and BEGIN not in after and END not in after and len(after) == V - 2


def test_thinkmode_continues_from_a_partially_emitted_end():
    output = []
    proc = think(2, [BEGIN], output)  # the template opened thinking
    assert proc.phase(0) == "thinking"
    step(proc, output, 9)
    assert step(proc, output, 3) == [4]  # the model's last free token began the end sequence


def test_thinkmode_lets_the_model_end_early_and_reads_the_prompt():
    output = []
    proc = think(10, [BEGIN, 7], output)
    step(proc, output, 9)
    after = step(proc, output, END)  # the model closed thinking itself
    assert proc.phase(0) == "after" and END not in after
    assert think(5, [BEGIN, 3, 4, 5], []).phase(0) == "after"  # a template that closed thinking
    budget_zero = think(0, [BEGIN, 3], [])  # prompt already holds "\n": continue with END
    assert allowed(budget_zero.apply(torch.zeros(1, V))[0]) == [4]


def test_thinkmode_leaves_requests_without_budget_alone_and_checks_config():
    proc = ThinkMode(V, end_think_token_ids=[7])
    add_all(proc, [(SamplingParams(), [1], []), (SamplingParams(max_thinking_tokens=0), [1], [])])
    out = proc.apply(torch.zeros(2, V))
    assert allowed(out[0]) == list(range(V)) and allowed(out[1]) == [7]  # no begin token: starts thinking
    with pytest.raises(ValueError, match="end_think_token_id is required"):
        ThinkMode(V, end_think_token_ids=[3, 4])
    with pytest.raises(ValueError, match="think token id 20 is outside"):
        ThinkMode(V, end_think_token_ids=[20])
    with pytest.raises(ValueError, match="end_think_token_id 9 is not in"):
        ThinkMode(V, end_think_token_ids=[3, 4], end_think_token_id=9)


# ---- speculative decoding ----


def test_spec_decode_masks_each_draft_position_with_its_own_state():
    output = []
    proc = think(1, [BEGIN], output)
    # Position 0: one free token left; after draft 9 the budget is spent: force 3, then 4, then 5.
    out = proc.apply_with_spec_decode(torch.zeros(4, V), [3], [[9, 3, 4]])
    assert [allowed(r) for r in out[1:]] == [[3], [4], [5]]
    assert len(allowed(out[0])) == V - 1
    mt = MinTokens(V, eos_token_id=0)
    add_all(mt, [(SamplingParams(min_tokens=2), None, [])])
    out = mt.apply_with_spec_decode(torch.zeros(3, V), [2], [[5, 6]])
    assert [0 in allowed(r) for r in out] == [False, False, True]


def test_min_p_and_logit_bias_apply_under_spec_decode():
    """vLLM drops these two under speculative decoding; logitgate applies them at every position."""
    bias, minp = LogitBias(V), MinP()
    requests = [(SamplingParams(logit_bias={3: 1.0}, min_p=0.5), None, []), (SamplingParams(), None, [])]
    add_all(bias, requests)
    add_all(minp, requests)
    out = bias.apply_with_spec_decode(torch.zeros(5, V), [2, 1])
    assert out[:3, 3].tolist() == [1.0, 1.0, 1.0] and out[3:].eq(0).all()
    out = minp.apply_with_spec_decode(out, [2, 1])
    assert all(allowed(r) == [3] for r in out[:3]) and all(len(allowed(r)) == V for r in out[3:])


def test_default_spec_decode_uses_each_request_row_for_every_position():
    class AddRow(LogitsProcessor):
        def is_argmax_invariant(self):
            return False

        def update_state(self, batch_update):
            pass

        def apply(self, logits):
            return logits + torch.arange(logits.shape[0], dtype=logits.dtype).unsqueeze(1)

    out = AddRow().apply_with_spec_decode(torch.zeros(6, 2), [2, 0, 1])
    assert out[:, 0].tolist() == [0, 0, 0, 1, 2, 2]


def test_spec_decode_layout_errors():
    proc = MultiSeq(V, eos_token_id=0)
    add_all(proc, [(SamplingParams(), None, []), (SamplingParams(), None, [])])
    with pytest.raises(ValueError, match="logits have 5 rows but num_draft_tokens"):
        proc.apply_with_spec_decode(torch.zeros(5, V), [1, 1])
    with pytest.raises(ValueError, match="request 1 has 0 draft token ids"):
        proc.apply_with_spec_decode(torch.zeros(4, V), [1, 1], [[3], []])
    with pytest.raises(ValueError, match="MultiSeq needs draft_token_ids"):
        proc.apply_with_spec_decode(torch.zeros(4, V), [1, 1])
    with pytest.raises(ValueError, match=r"num_draft_tokens\[0\] is -1"):
        proc.apply_with_spec_decode(torch.zeros(2, V), [-1, 1])
    assert proc.apply_with_spec_decode(torch.zeros(2, V), [0, 0]).eq(0).all()  # no drafts: no ids needed
