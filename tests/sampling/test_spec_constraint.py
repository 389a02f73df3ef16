"""Constraint-aware speculative decoding: masks at every draft and bonus position."""
import pytest
import torch

from logitgate.backends.reference import pack_bitmask
from logitgate.sampling import rejection, spec_constraint
from logitgate.sampling.spec_constraint import valid_draft_counts
from tests.helpers.devices import on_backend_device

# Inputs are built on the CPU; a call with backend= runs them on that backend's device.
rejection_sample = on_backend_device(rejection.rejection_sample)
constrain_spec_logits = on_backend_device(spec_constraint.constrain_spec_logits)

VOCAB = 40


def allowed_rows(rows, seed, density=0.4):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, VOCAB, generator=g) < density
    allowed[:, 0] |= ~allowed.any(-1)  # never an empty row
    return allowed


def test_rows_are_masked_and_split_in_vllm_layout(backend):
    counts = [2, 0, 3]
    rows = sum(counts) + len(counts)
    logits = torch.arange(rows, dtype=torch.float32, device=backend.device).unsqueeze(-1).repeat(1, VOCAB)  # row id everywhere
    allowed = allowed_rows(rows, 1)
    drafts = torch.tensor([1, 2, 3, 4, 5])
    out = constrain_spec_logits(logits, pack_bitmask(allowed), drafts, counts, backend=backend)
    # Layout: r0 drafts at rows 0, 1, bonus 2; r1 bonus 3; r2 drafts 4, 5, 6, bonus 7.
    assert out.target_logits.amax(-1).tolist() == [0.0, 1.0, 4.0, 5.0, 6.0]
    assert out.bonus_logits.amax(-1).tolist() == [2.0, 3.0, 7.0]
    assert torch.equal(torch.isinf(logits).cpu(), ~allowed)  # masked in place
    assert torch.equal(torch.isinf(out.target_logits).cpu(), ~allowed[[0, 1, 4, 5, 6]])


def test_valid_draft_counts():
    allowed = torch.zeros(6, VOCAB, dtype=torch.bool)
    allowed[:, 7] = True
    drafts = torch.tensor([7, 7, 3, 7, -1, 7])
    cu = torch.tensor([3, 3, 5, 6], dtype=torch.int32)  # [7, 7, 3] [] [7, -1] [7]
    counts = valid_draft_counts(drafts, cu, pack_bitmask(allowed), VOCAB)
    assert counts.tolist() == [2, 0, 1, 1]
    # Ids past the bitmask's coverage are left unmasked by the apply, so they count as valid.
    narrow = pack_bitmask(allowed[:, :32])
    assert valid_draft_counts(torch.tensor([35]), torch.tensor([1], dtype=torch.int32), narrow[:1], VOCAB).tolist() == [1]
    assert valid_draft_counts(torch.tensor([VOCAB]), torch.tensor([1], dtype=torch.int32), narrow[:1], VOCAB).tolist() == [0]


@pytest.mark.parametrize("mode", ["greedy", "ngram", "draft_probs"])
def test_accepted_tokens_always_satisfy_the_constraint(backend, mode):
    g = torch.Generator().manual_seed(4)
    counts = [4, 1, 3, 0, 4, 2]
    n, b = sum(counts), len(counts)
    for trial in range(6):
        allowed = allowed_rows(n + b, 100 + trial, density=0.3)
        logits = torch.randn(n + b, VOCAB, generator=g) * 3
        # Drafts are the UNconstrained argmax: plausible for the model, often invalid for the grammar.
        draft_rows = torch.cat([torch.arange(s + r, s + r + c) for r, (s, c) in enumerate(zip([0, 4, 5, 8, 8, 12], counts))])
        drafts = logits[draft_rows].argmax(-1)
        constrained = constrain_spec_logits(logits, pack_bitmask(allowed), drafts, counts, backend=backend)
        kwargs = {}
        if mode != "greedy":
            kwargs["temperature"] = torch.ones(b)
        if mode == "draft_probs":
            kwargs["draft_probs"] = torch.softmax(torch.randn(n, VOCAB, generator=g), -1)
        bonus = constrained.bonus_logits.argmax(-1)
        out = rejection_sample(drafts, counts, constrained.target_logits, bonus, backend=backend, **kwargs)
        valid = constrained.num_valid_drafts.tolist()
        start = 0
        for r, count in enumerate(counts):
            row = [t for t in out[r].tolist() if t >= 0]
            accepted = len(row) - 1
            assert accepted <= valid[r]
            # every emitted token (accepted drafts, correction, bonus) is allowed at its position
            for j, token in enumerate(row):
                position_row = start + r + j  # the row of position j in the (N + B) layout
                assert allowed[position_row, token], f"request {r} position {j}: token {token} not allowed"
            start += count


@pytest.mark.parametrize("mode", ["greedy", "ngram", "one_hot_draft_probs"])
def test_forced_tokens_as_drafts_are_always_accepted(backend, mode):
    """Positions whose mask allows one token (a tree's forced continuation) accept that draft."""
    forced = [5, 9, 2]
    counts = [3] * 50
    rows_per_request = len(forced) + 1
    allowed = torch.zeros(rows_per_request, VOCAB, dtype=torch.bool)
    for j, t in enumerate(forced):
        allowed[j, t] = True
    allowed[-1] = True  # the bonus position is free
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(rows_per_request * len(counts), VOCAB, generator=g) * 4
    drafts = torch.tensor(forced * len(counts))
    bitmask = pack_bitmask(allowed).repeat(len(counts), 1)
    constrained = constrain_spec_logits(logits, bitmask, drafts, counts, backend=backend)
    assert constrained.num_valid_drafts.tolist() == [3] * len(counts)
    kwargs = {} if mode == "greedy" else {"temperature": torch.full((len(counts),), 1.3)}
    if mode == "one_hot_draft_probs":
        kwargs["draft_probs"] = torch.nn.functional.one_hot(drafts, VOCAB).float()
    out = rejection_sample(drafts, counts, constrained.target_logits, torch.full((len(counts),), 11), backend=backend, **kwargs)
    assert out.tolist() == [forced + [11]] * len(counts)


def test_bad_shapes_are_named():
    logits = torch.zeros(4, VOCAB)
    bitmask = pack_bitmask(torch.ones(4, VOCAB, dtype=torch.bool))
    with pytest.raises(ValueError, match="logits must be 2-D with 5 rows"):
        constrain_spec_logits(logits, bitmask, torch.tensor([1, 2, 3]), [3, 0])
    with pytest.raises(ValueError, match="bitmask must be 2-D with one row per logits row"):
        constrain_spec_logits(logits, bitmask[:3], torch.tensor([1, 2]), [2, 0])
    with pytest.raises(ValueError, match="draft_token_ids must be a 1-D tensor of the 2 draft tokens"):
        constrain_spec_logits(logits, bitmask, torch.tensor([1]), [2, 0])


def test_rows_masks_only_the_constrained_rows():
    import logitgate
    from logitgate.sampling.spec_constraint import constrain_spec_logits

    vocab = 40
    logits = torch.zeros(4, vocab)  # request 0: one draft + bonus; request 1: one draft + bonus
    bitmask = logitgate.bitmask_from_token_ids([[1], [2], [3], [4]], vocab)
    out = constrain_spec_logits(logits, bitmask, torch.tensor([1, 3]), [1, 1], rows=[0, 1])
    assert torch.isfinite(logits[0]).sum() == 1 and torch.isfinite(logits[1]).sum() == 1
    assert torch.isfinite(logits[2:]).all()  # rows 2-3 were not named: left alone
    assert out.num_valid_drafts.tolist() == [1, 1]
