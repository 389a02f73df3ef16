"""CUDA's v2 sampling (LOGITGATE_CUDA_KERNELS=sampling=v2) through the CUDA backend's own dispatch,
its Triton kernels under TRITON_INTERPRET=1 on CPU tensors (the real GPU runs the `backend` tests of
test_sampler.py, test_sampling_ops.py and test_sampling_distributions.py with both variants).

v2 draws with Exp(1) noise generated from one Philox seed per row; `philox_exponential_triton`
writes that noise out, so each result is checked token for token against the one torch reference:
temperature, top-k / top-p (apply_top_k_top_p_reference), softmax, the exponential race with that
noise, the fallback token for rows without a distribution, greedy rows by argmax."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from logitgate.backends import cuda as cuda_module
from logitgate.backends.base import NOISE_PHILOX
from logitgate.backends.reference import (
    apply_top_k_top_p_reference,
    exponential_race,
    race_sample_reference,
    sample_from_logits_reference,
)
from logitgate.sampling import Sampler, SamplingMetadata, SamplingParams, make_generator, ops
from logitgate.sampling.params import SAMPLING_EPS
from tests.helpers.cuda_variants import interpreted_v2_fixture, needs_interpreter
from tests.hostile.test_hostile_sampling import check_sampler_rows

pytestmark = needs_interpreter


cuda = interpreted_v2_fixture("sampling")


def noise_of(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    from logitgate.backends.triton.philox import philox_exponential_triton

    return philox_exponential_triton(seeds, vocab)


def reference_step(logits, params, q):
    """The reference of one Sampler step for `params` with race noise q (B, V), and the filtered
    probabilities it draws from."""
    t = torch.tensor([p.temperature for p in params])
    greedy = t < SAMPLING_EPS
    t = torch.where(greedy, 1.0, t)
    k = torch.tensor([p.top_k for p in params])
    p = torch.tensor([p.top_p for p in params])
    sampled = sample_from_logits_reference(logits, t, k, p, q)
    probs = apply_top_k_top_p_reference(logits / t.unsqueeze(1), k, p).softmax(-1)
    return torch.where(greedy, logits.argmax(-1), sampled), probs


def near_tie(probs_row, q_row, token, expected) -> bool:
    """The two tokens' race scores agree to float rounding (Triton's exp and division differ from
    torch's by an ulp or two), or top-p's cut lies at a float-rounding tie."""
    a, b = (float(probs_row[i] / q_row[i]) for i in (token, expected))
    return abs(a - b) <= 1e-5 * max(a, b)


@st.composite
def sampler_cases(draw):
    rows = draw(st.integers(1, 4))
    vocab = draw(st.integers(4, 200))
    top = draw(st.integers(1, min(vocab - 1, 40)))
    params = [
        SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.6, 1.0, 1.7])),
            top_k=draw(st.integers(1, top)),
            top_p=draw(st.sampled_from([1.0, 0.9, 0.5, 0.2])),
            seed=draw(st.sampled_from([None, None, 7])),
        )
        for _ in range(rows)
    ]
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16))))
    logits *= draw(st.sampled_from([0.5, 3.0, 10.0]))
    if draw(st.booleans()):
        logits = logits.round()  # ties, also at the cuts and across chunks
    corrupt = draw(st.sampled_from(["none", "nan", "pos_inf", "all_neg_inf"]))
    if corrupt == "nan":
        logits[0, vocab // 2] = float("nan")
    elif corrupt == "pos_inf":
        logits[-1, 1] = float("inf")
    elif corrupt == "all_neg_inf":
        logits[0] = float("-inf")
    return logits, params, draw(st.booleans())


@settings(max_examples=12)
@given(case=sampler_cases())
def test_v2_sampler_equals_the_reference_draw_with_its_noise(cuda, case):
    logits, params, with_processor = case
    generators = {r: make_generator(p.seed) for r, p in enumerate(params) if p.seed is not None}
    processors = None
    if with_processor:  # an argmax-invariant processor: the temperature is applied before, in place
        from logitgate.sampling.processors import LogitsProcessors, MinP

        processors = LogitsProcessors([MinP(torch.device("cpu"))])
    metadata = SamplingMetadata.from_params(params, generators=generators, logitsprocs=processors)
    metadata.prefetch_noise(*logits.shape, backend=cuda)
    if metadata.noise is None:  # every row greedy
        return
    assert metadata.noise.kind == NOISE_PHILOX and metadata.noise.shape == (logits.shape[0],)
    expected, probs = reference_step(logits, params, noise_of(metadata.noise.values, logits.shape[1]))
    got = Sampler(backend=cuda)(logits.clone(), metadata).sampled_token_ids[:, 0].long()
    assert metadata.noise.consumed
    q = noise_of(metadata.noise.values, logits.shape[1])
    for r in range(logits.shape[0]):
        if got[r] != expected[r]:
            assert near_tie(probs[r], q[r], int(got[r]), int(expected[r])), (r, int(got[r]), int(expected[r]))


@settings(max_examples=8)
@given(case=sampler_cases())
def test_v2_without_every_row_top_k_filters_then_races(cuda, case):
    """A row without top-k: no one-go kernel; the filters run, then v2's random_sample."""
    logits, params, _ = case
    params[0] = SamplingParams(temperature=1.0, top_p=params[0].top_p)
    metadata = SamplingMetadata.from_params(params)
    assert metadata.max_top_k is None
    metadata.prefetch_noise(*logits.shape, backend=cuda)
    expected, probs = reference_step(logits, params, noise_of(metadata.noise.values, logits.shape[1]))
    got = Sampler(backend=cuda)(logits.clone(), metadata).sampled_token_ids[:, 0].long()
    q = noise_of(metadata.noise.values, logits.shape[1])
    for r in range(logits.shape[0]):
        if got[r] != expected[r]:
            assert near_tie(probs[r], q[r], int(got[r]), int(expected[r])), (r, int(got[r]), int(expected[r]))


@settings(max_examples=10)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 5), vocab=st.integers(1, 150),
       kind=st.sampled_from(["none", "zero", "nan", "inf", "unnormalised"]))
def test_v2_random_sample_equals_the_race_and_the_fallback(cuda, seed, rows, vocab, kind):
    probs = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(seed)) ** 2
    if kind == "zero":
        probs[0] = 0.0
    elif kind == "nan":
        probs[-1, vocab // 2] = float("nan")
    elif kind == "inf":
        probs[0, -1] = float("inf")
    elif kind == "unnormalised":
        probs *= 1e3
    noise = ops.draw_sampling_noise(rows, vocab, backend=cuda)
    q = noise_of(noise.values, vocab)
    assert torch.equal(ops.random_sample(probs, backend=cuda, noise=noise), race_sample_reference(probs, q))


def test_v2_noise_protocol(cuda, monkeypatch):
    """Seeded rows reproduce whatever the default generator does, prefetched or not; the noise kind
    follows the variable; the noise of a row is Exp(1) per token from its seed alone."""
    probs = torch.rand(4, 90)
    gens = lambda: {1: make_generator(3), 3: make_generator(4)}  # noqa: E731
    torch.manual_seed(0)
    now = ops.random_sample(probs, gens(), backend=cuda)
    torch.manual_seed(1)
    generators = gens()
    ahead = ops.random_sample(probs, generators, backend=cuda, noise=ops.draw_sampling_noise(4, 90, generators, backend=cuda))
    assert now[[1, 3]].tolist() == ahead[[1, 3]].tolist()
    assert len({int(ops.random_sample(probs, {0: make_generator(s)}, backend=cuda)[0]) for s in range(12)}) > 1
    monkeypatch.setenv("LOGITGATE_CUDA_KERNELS", "sampling=current")
    with pytest.raises(ValueError, match="noise is 'exponential' but backend 'cuda-interpreted' samples with 'philox'"):
        monkeypatch.setenv("LOGITGATE_CUDA_KERNELS", "current")
        noise = ops.draw_sampling_noise(4, 90, backend=cuda)
        monkeypatch.setenv("LOGITGATE_CUDA_KERNELS", "sampling=v2")
        ops.random_sample(probs, backend=cuda, noise=noise)


def test_philox_noise_is_exponential_and_the_race_exact(assert_distribution):
    """The noise is Exp(1), independent across tokens and seeds (chi-square of the race it drives,
    20000 draws), so argmax(p / q) draws p exactly."""
    g = torch.Generator().manual_seed(5)
    probs = torch.rand(40, generator=g) ** 3
    probs[[2, 9]] = 0.0
    probs /= probs.sum()
    draws = 20000
    seeds = torch.randint(0, 2**62, (draws // 1000,), generator=g)
    q = noise_of(seeds, 1000 * 40).view(draws, 40)  # tokens of one seed split into rows: i.i.d. either way
    assert_distribution(exponential_race(probs.expand(draws, -1), q), probs)
    flat = q.flatten().double()
    assert abs(float(flat.mean()) - 1) < 0.01 and abs(float(flat.var()) - 1) < 0.03
    assert float(flat.min()) > 0 and bool(torch.isfinite(flat).all())


# The backend tests of test_sampler.py / test_sampling_ops.py / the hostile fallback check, on the
# interpreted CUDA backend with v2 (imported inside each test, so that pytest does not collect
# them here a second time).


def test_v2_sampler_behavioural_cases(cuda, monkeypatch):
    monkeypatch.setattr(cuda_module, "CUDA_SAMPLE_CHUNK", 8192)  # one program per row: the interpreter is slow
    from tests.sampling import test_sampler, test_sampling_ops

    test_sampler.test_seeded_requests_are_reproducible(cuda, "v2")
    test_sampler.test_prefetched_noise_gives_the_same_tokens(cuda, "v2")
    test_sampling_ops.test_prefetched_noise_equals_drawing_now(cuda, "v2")


@settings(max_examples=8)
@given(data=st.data())
def test_v2_rows_without_a_distribution_give_the_fallback_token(cuda, data):
    check_sampler_rows(cuda, data, max_rows=3, max_vocab=40)


def test_v2_signed_zeros_tie_at_the_top_k_cut(cuda):
    """-0.0 == 0.0: a top-k cut at zero keeps both (their bits would order -0.0 below 0.0)."""
    logits = torch.tensor([[0.0, -0.0, -0.0, 0.0, -0.0, -1.0], [-0.0, -0.0, 0.0, -2.0, -0.0, -0.0]])
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_k=2, top_p=0.5)]
    for _ in range(4):
        metadata = SamplingMetadata.from_params(params)
        metadata.prefetch_noise(*logits.shape, backend=cuda)
        expected, _ = reference_step(logits, params, noise_of(metadata.noise.values, logits.shape[1]))
        assert torch.equal(Sampler(backend=cuda)(logits.clone(), metadata).sampled_token_ids[:, 0].long(), expected)
