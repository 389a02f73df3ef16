"""CUDA's v2 rejection sampling (LOGITGATE_CUDA_KERNELS=rejection=v2) through the CUDA backend's own
dispatch, its Triton kernels under TRITON_INTERPRET=1 on CPU tensors (the real GPU runs the
`backend` tests of test_rejection.py and test_rejection_distribution.py with both variants).

v2 recovers with Exp(1) noise generated from one Philox seed per request; the test replays the
call's random numbers (uniforms, then seeds, from the default generator) and checks the output
against the torch reference (accept, recovery weights, the race with that noise, the layout)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from logitgate.backends import cuda as cuda_module
from logitgate.backends import reference as R
from logitgate.backends.sampling_rules import draw_seeds
from logitgate.sampling.rejection import chain_speculative_sampling, draw_draft_uniforms, rejection_sample
from tests.helpers.cuda_variants import interpreted_v2_fixture, needs_interpreter
from tests.helpers.sampling_helpers import near_decision

pytestmark = needs_interpreter


cuda = interpreted_v2_fixture("rejection")


def philox_noise(seeds, vocab):
    from logitgate.backends.triton.philox import philox_exponential_triton

    return philox_exponential_triton(seeds, vocab)


@st.composite
def cases(draw):
    counts = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4))
    vocab = draw(st.sampled_from([2, 7, 40, 100]))
    n = sum(counts)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    logits = torch.randn(n, vocab, generator=g) * draw(st.sampled_from([0.5, 3.0, 10.0]))
    corrupt = draw(st.sampled_from(["none", "none", "nan", "neg_inf", "pos_inf"]))
    if n and corrupt == "nan":
        logits[0, vocab // 2] = float("nan")
    elif n and corrupt == "neg_inf":
        logits[-1] = float("-inf")
    elif n and corrupt == "pos_inf":
        logits[0, 1] = float("inf")
    probs = torch.softmax(logits.nan_to_num(0.0, 0.0, 0.0) + torch.randn(n, vocab, generator=g), -1) if draw(st.booleans()) else None
    pick = torch.rand(n, generator=g)
    drafts = torch.where(pick < 0.6, logits.nan_to_num(0.0).argmax(-1), torch.randint(0, vocab, (n,), generator=g))
    drafts = torch.where(pick > 0.93, -1, drafts)
    bonus = torch.randint(0, vocab, (len(counts),), generator=g)
    temperature = draw(st.sampled_from(["none", "mixed", "random"]))
    if temperature == "mixed":
        temperature = torch.tensor([0.0, 0.7, 1.0, 1.3][: len(counts)])
    elif temperature == "random":
        temperature = torch.rand(len(counts), generator=g) + 0.4
    else:
        temperature = None
    return counts, logits, probs, drafts, bonus, temperature, draw(st.sampled_from([None, "top_k", "top_p"]))


def reference_output(counts, logits, probs, drafts, bonus, temperature, uniform, q):
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    return R.rejection_verify_reference(cu, drafts, logits, temperature, probs, uniform, q, bonus, max(counts) + 1)


def assert_same_up_to_rounding(out, expected, counts, logits, probs, drafts, temperature, uniform, q):
    """out == expected, except where float rounding may decide (Triton's exp and logsumexp differ
    from torch's in the last bits): an acceptance ratio within 1e-4 of its uniform, or a recovered
    token whose race score ties the reference token's to 1e-4."""
    if torch.equal(out, expected):
        return
    b = len(counts)
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    token_t = None
    if temperature is not None:
        token_t = temperature[torch.repeat_interleave(torch.arange(b), torch.tensor(counts))]
        token_t = torch.where(token_t == 0, 1.0, token_t)
    borderline = near_decision(cu, drafts, logits, token_t, probs, uniform) if uniform is not None else []
    for r, (a, e) in enumerate(zip(out.tolist(), expected.tolist())):
        if a == e:
            continue
        first = next(i for i, (x, y) in enumerate(zip(a, e)) if x != y)
        assert a[:first] == e[:first], (r, a, e)
        start = int(cu[r]) - counts[r]
        if borderline and first < counts[r] and borderline[start + first]:
            continue  # the acceptance of draft `first` ties its uniform
        assert temperature is not None and float(temperature[r]) > 0, (r, a, e)  # greedy rows are exact
        row = start + first
        z = R.tempered_logits(logits[row : row + 1], token_t[row : row + 1]).double()
        target = (z - z.logsumexp(-1, keepdim=True)).exp()[0]
        residual = target - (probs[row].double() if probs is not None else 0.0)
        weights = residual.clamp(min=0) if residual.clamp(min=0).sum() > 0 else target
        score = weights / q[r].double()
        assert abs(float(score[a[first]] - score[e[first]])) <= 1e-4 * float(score.max()), (r, a, e)


@settings(max_examples=15)
@given(case=cases())
def test_v2_rejection_equals_the_reference_with_its_noise(cuda, case):
    counts, logits, probs, drafts, bonus, temperature, _ = case
    torch.manual_seed(7)
    out = rejection_sample(drafts, counts, logits, bonus, draft_probs=probs, temperature=temperature, backend=cuda)
    torch.manual_seed(7)  # replay: the uniforms, then one seed per request
    n, vocab = logits.shape
    uniform = draw_draft_uniforms(counts, n, {}, torch.device("cpu")) if temperature is not None else None
    q = philox_noise(draw_seeds(len(counts), {}, torch.device("cpu")), vocab) if temperature is not None else None
    expected = reference_output(counts, logits, probs, drafts, bonus, temperature, uniform, q)
    assert_same_up_to_rounding(out, expected, counts, logits, probs, drafts, temperature, uniform, q)


@settings(max_examples=8)
@given(case=cases())
def test_v2_recover_after_top_k_top_p(cuda, case):
    """With top-k/top-p the accept kernels run step by step and v2 recovers from the seeds: the
    same tokens as the reference's race with that noise."""
    counts, logits, probs, drafts, bonus, _, which = case
    if sum(counts) == 0:
        return
    b, vocab = len(counts), logits.shape[1]
    temperature = torch.rand(b) + 0.5
    top_k = torch.full((b,), max(1, vocab // 3)) if which == "top_k" else None
    top_p = torch.full((b,), 0.8) if which != "top_k" else None
    torch.manual_seed(3)
    out = rejection_sample(drafts, counts, logits, bonus, draft_probs=probs, temperature=temperature, top_k=top_k,
                           top_p=top_p, backend=cuda)
    torch.manual_seed(3)
    uniform = draw_draft_uniforms(counts, sum(counts), {}, torch.device("cpu"))
    q = philox_noise(draw_seeds(b, {}, torch.device("cpu")), vocab)
    token_request = torch.repeat_interleave(torch.arange(b), torch.tensor(counts))
    processed = R.tempered_logits(logits, temperature[token_request])
    R.apply_top_k_top_p_reference(processed, None if top_k is None else top_k[token_request],
                                  None if top_p is None else top_p[token_request])
    expected = reference_output(counts, processed, probs, drafts, bonus, torch.ones(b), uniform, q)
    assert_same_up_to_rounding(out, expected, counts, processed, probs, drafts, torch.ones(b), uniform, q)


def test_v2_seeded_requests_are_reproducible_and_draw_only_with_drafts(cuda):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    drafts = torch.randint(0, 50, (6,), generator=g)
    args = (drafts, [3, 0, 3], logits, torch.tensor([1, 2, 3]))

    def run(seed):
        torch.manual_seed(seed)
        gens = {0: torch.Generator().manual_seed(5), 1: torch.Generator().manual_seed(6)}
        out = rejection_sample(*args, temperature=torch.ones(3), generators=gens, backend=cuda)
        return out, gens[1].initial_seed(), torch.rand(1, generator=gens[1])

    first, second = run(1), run(2)
    assert first[0][0].tolist() == second[0][0].tolist()  # seeded: the default generator does not matter
    fresh = torch.rand(1, generator=torch.Generator().manual_seed(6))
    assert torch.equal(first[2], fresh)  # request 1 has no drafts: its generator was not touched


def test_v2_chain_speculative_sampling_in_one_go(cuda):
    g = torch.Generator().manual_seed(1)
    draft_probs = torch.softmax(torch.randn(2, 3, 20, generator=g), -1)
    target_probs = torch.softmax(torch.randn(2, 4, 20, generator=g), -1)
    ids = torch.randint(0, 20, (2, 3), generator=g)
    out, accepted, emitted = chain_speculative_sampling(draft_probs, ids, target_probs, generator=torch.Generator().manual_seed(0), backend=cuda)
    assert out.shape == (2, 4) and ((out >= -1) & (out < 20)).all()
    for r in range(2):
        n = int(emitted[r])
        assert out[r, :n].tolist() == ids[r, :n].tolist() and out[r, n] >= 0 and (out[r, n + 1 :] == -1).all()


# The backend tests of test_rejection.py, on the interpreted CUDA backend with v2 (imported inside
# each test, so that pytest does not collect them here a second time).


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:divide by zero:RuntimeWarning")
@pytest.mark.parametrize("poison", ["nan", "neg_inf", "pos_inf", "nan_draft_probs", "zero_draft_probs", "huge"])
@pytest.mark.parametrize("mode", ["greedy", "random", "random_draft_probs"])
def test_v2_degenerate_rows_never_emit_out_of_vocab_ids(cuda, poison, mode):
    from tests.sampling.test_rejection import test_degenerate_rows_never_emit_out_of_vocab_ids as check

    check(cuda, poison, mode, "v2")


def test_v2_behavioural_cases(cuda, monkeypatch):
    monkeypatch.setattr(cuda_module, "CUDA_SAMPLE_CHUNK", 8192)  # one program per row: the interpreter is slow
    from tests.sampling import test_rejection as cases

    cases.test_zero_temperature_is_greedy_and_mixes_with_random(cuda, "v2")
    cases.test_device_resident_temperature_runs_both_paths(cuda, monkeypatch, "v2")
    cases.test_random_rejection_emits_recovered_token_and_pads(cuda, "v2")
    cases.test_random_acceptance_of_certain_drafts(cuda, "v2")
    for mode in ("greedy", "ngram", "draft_probs"):
        cases.test_placeholder_drafts_are_always_rejected(cuda, mode, "v2")
    cases.test_out_of_vocabulary_drafts_are_placeholders(cuda, "v2")
    cases.test_requests_without_drafts_draw_nothing_from_their_generator(cuda, "v2")
    cases.test_temperature_applies_to_target_not_draft_probs(cuda, "v2")
    cases.test_inputs_are_not_modified(cuda, "v2")
    cases.test_chain_speculative_sampling_flashinfer_example(cuda, "v2")


@pytest.mark.parametrize("kind", ["all_nan", "one_nan", "all_neg_inf", "pos_inf"])
def test_v2_rows_without_a_distribution_recover_the_fallback(cuda, kind):
    from tests.hostile.test_hostile_sampling import (
        test_rejection_rows_without_a_distribution_accept_and_recover_the_fallback as check,
    )

    check(cuda, kind, None, "v2")
