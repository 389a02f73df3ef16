"""Sampling kernels on every reachable backend against the one torch reference; noise protocol;
validation at the public boundary."""
import os

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from logitgate.backends.base import NOISE_EXPONENTIAL, NOISE_PHILOX, NOISE_UNIFORM
from logitgate.backends.cpu.sampling_kernels import inverse_cdf_sample_cpu
from logitgate.backends.emulated import EmulatedEvent, EmulatedNpuBackend
from logitgate.backends.reference import apply_top_k_top_p_reference, exponential_race, inverse_cdf_sample_reference
from logitgate.sampling import ops
from tests.helpers.devices import to_device
from tests.helpers.sampling_helpers import interpreted_triton


@st.composite
def filter_cases(draw):
    rows = draw(st.integers(1, 6))
    vocab = draw(st.integers(1, 400))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.1, 1.0, 4.0, 20.0]))
    ties = draw(st.booleans())
    use_k, use_p = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
    every_row_k = draw(st.booleans())
    neg_inf = draw(st.sampled_from([0.0, 0.0, 0.3]))
    return rows, vocab, seed, scale, ties, use_k, use_p, every_row_k, neg_inf


def make_filter_case(rows, vocab, seed, scale, ties, use_k, use_p, every_row_k, neg_inf):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale
    if ties:  # bf16-like coarse logits: many ties, also at the cut
        logits = logits.round()
    logits[torch.rand(rows, vocab, generator=g) < neg_inf] = float("-inf")
    logits[:, 0] = logits[:, 0].clamp(min=-1e4)  # at least one finite logit per row
    k = None
    if use_k:
        low = 1 if every_row_k else -1
        k = torch.randint(low, vocab + 2, (rows,), generator=g)
        if every_row_k:
            k = k.clamp(max=max(1, vocab - 1))
    p = None
    if use_p:
        p = torch.rand(rows, generator=g).clamp(min=0.02)
        p[torch.rand(rows, generator=g) < 0.2] = 1.0
    return logits, k, p


def top_p_margin(logits, k, p) -> float:
    """How close top-p's cut comes to a tie: min |mass above a probability - p| (float64)."""
    if p is None:
        return float("inf")
    probs = apply_top_k_top_p_reference(logits.clone(), k, None).softmax(-1).double()
    above = (probs.unsqueeze(2) * (probs.unsqueeze(2) > probs.unsqueeze(1))).sum(1)
    return float((above - p.double().unsqueeze(1)).abs().min())


@given(case=filter_cases())
def test_top_k_top_p_matches_reference(backend, case):
    if interpreted_triton(backend):
        pytest.skip("the interpreted Triton kernels have their own, smaller test")
    logits, k, p = make_filter_case(*case)
    expected = apply_top_k_top_p_reference(logits.clone(), k, p)
    got = logits.clone().to(backend.device)
    dev = lambda t: None if t is None else t.to(backend.device)  # noqa: E731
    max_top_k = int(k.max()) if k is not None and bool((k > 0).all()) else None
    out = ops.apply_top_k_top_p(got, dev(k), dev(p), max_top_k=max_top_k, backend=backend)
    assert out.data_ptr() == got.data_ptr()  # in place
    assert torch.equal(got.cpu(), expected)


@given(case=filter_cases())
def test_filtered_probs_are_the_softmax_of_the_filtered_logits(backend, case):
    """ops.top_k_top_p_probs: the same filter in place, and probabilities proportional to the
    softmax of what it kept (the CPU backend reuses top-p's softmax with the removed tokens zeroed)."""
    if interpreted_triton(backend):
        pytest.skip("the interpreted Triton kernels have their own, smaller test")
    logits, k, p = make_filter_case(*case)
    expected = apply_top_k_top_p_reference(logits.clone(), k, p)
    dev = lambda t: None if t is None else t.to(backend.device)  # noqa: E731
    got, probs = ops.top_k_top_p_probs(logits.clone().to(backend.device), dev(k), dev(p), backend=backend)
    assert torch.equal(got.cpu(), expected)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    probs = probs.cpu().double()
    assert (probs[expected == float("-inf")] == 0).all()  # removed tokens have no mass
    torch.testing.assert_close(probs / probs.sum(-1, keepdim=True), expected.double().softmax(-1), rtol=1e-5, atol=1e-7)


needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@needs_interpreter
@settings(max_examples=8)
@given(case=filter_cases())
def test_triton_top_k_top_p_matches_reference(case):
    """The Triton bisection kernels with Ascend sizing. Top-p sums in float32: cases whose cut
    lies within 1e-5 of a tie are left out."""
    logits, k, p = make_filter_case(*case)
    assume(top_p_margin(logits, k, p) > 1e-5)
    expected = apply_top_k_top_p_reference(logits.clone(), k, p)
    npu = EmulatedNpuBackend(triton_ascend=True, vector_cores=4)
    assert torch.equal(ops.apply_top_k_top_p(logits.clone(), k, p, backend=npu), expected)


@needs_interpreter
def test_triton_top_k_top_p_rows_spanning_tiles():
    from logitgate.backends.triton.sampling import apply_top_k_top_p_triton

    logits, k, p = make_filter_case(3, 100, 5, 2.0, True, True, True, False, 0.1)
    assert top_p_margin(logits, k, p) > 1e-5
    expected = apply_top_k_top_p_reference(logits.clone(), k, p)
    assert torch.equal(apply_top_k_top_p_triton(logits.clone(), k, p, block=32, max_programs=2), expected)


@pytest.mark.parametrize("k", [1, 50, 600, 9000])
@pytest.mark.parametrize("p", [None, 0.5, 0.95])
def test_top_k_top_p_large_vocab(backend, k, p):
    """Real vocabulary sizes: the heap and introselect paths of top-k, histogram buckets of top-p."""
    if interpreted_triton(backend):
        pytest.skip("too slow under the Triton interpreter")
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(3, 32000, generator=g) * torch.tensor([[0.5], [3.0], [8.0]])
    kk = torch.full((3,), k)
    pp = None if p is None else torch.full((3,), p)
    expected = apply_top_k_top_p_reference(logits.clone(), kk, pp)
    got = ops.apply_top_k_top_p(*to_device((logits.clone(), kk, pp), backend.device), backend=backend)
    assert torch.equal(got.cpu(), expected)
    kept = (expected > float("-inf")).sum(dim=-1)
    assert (kept <= k).all() and (kept >= 1).all()


@pytest.mark.parametrize("p", [0.3, 0.9, 0.999])
def test_top_p_flat_and_peaked_rows(backend, p):
    """A flat row puts the cut inside one crowded histogram bucket; a peaked row keeps one token."""
    if interpreted_triton(backend):
        pytest.skip("too slow under the Triton interpreter")
    logits = torch.stack([torch.zeros(5000), torch.linspace(0, 1e-3, 5000), torch.full((5000,), -30.0)])
    logits[2, 17] = 0.0
    expected = apply_top_k_top_p_reference(logits.clone(), None, torch.full((3,), p))
    got = ops.apply_top_k_top_p(*to_device((logits.clone(), None, torch.full((3,), p)), backend.device), backend=backend)
    assert torch.equal(got.cpu(), expected)
    assert (expected[0] > float("-inf")).all()  # all tied: kept together
    assert (expected[2] > float("-inf")).sum() == 1


def test_top_k_top_p_half_precision_logits(backend):
    logits = torch.randn(4, 300).to(torch.bfloat16)
    k, p = torch.tensor([3, 0, 50, 299]), torch.tensor([0.9, 0.5, 1.0, 0.7])
    expected = apply_top_k_top_p_reference(logits.float(), k, p).to(torch.bfloat16)
    got = ops.apply_top_k_top_p(*to_device((logits.clone(), k, p), backend.device), backend=backend)
    assert got.dtype == torch.bfloat16 and torch.equal(got.cpu(), expected)


@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 8), vocab=st.integers(1, 3000), zeros=st.sampled_from([0.0, 0.5, 0.99]))
def test_inverse_cdf_kernel_matches_reference(seed, rows, vocab, zeros):
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(rows, vocab, generator=g)
    probs[torch.rand(rows, vocab, generator=g) < zeros] = 0
    probs[:, -1] += 1e-3  # every row has mass
    u = torch.rand(rows, dtype=torch.float64, generator=g)
    u[0] = 0.0
    got = inverse_cdf_sample_cpu(probs, u)
    assert torch.equal(got, inverse_cdf_sample_reference(probs, u))
    assert (probs.gather(1, got.unsqueeze(1)) > 0).all()


def test_exponential_race_is_argmax_of_ratio():
    probs = torch.tensor([[0.2, 0.8, 0.0], [0.5, 0.25, 0.25]])
    q = torch.tensor([[0.1, 1.0, 1e-30], [4.0, 0.1, 1.0]])
    assert exponential_race(probs, q).tolist() == [0, 1]


def test_seeded_rows_are_reproducible(backend, sampling_variant):
    probs = torch.rand(6, 500).to(backend.device)
    gens = lambda: {1: torch.Generator(backend.device).manual_seed(7), 4: torch.Generator(backend.device).manual_seed(8)}  # noqa: E731
    torch.manual_seed(0)
    first = ops.random_sample(probs, gens(), backend=backend)
    torch.manual_seed(12345)  # the unseeded rows' source changes, the seeded rows must not
    second = ops.random_sample(probs, gens(), backend=backend)
    assert first[[1, 4]].tolist() == second[[1, 4]].tolist()
    draws = [ops.random_sample(probs, {1: torch.Generator(backend.device).manual_seed(s)}, backend=backend)[1].item() for s in range(30)]
    assert len(set(draws)) > 1  # the seed matters
    as_list = [None, torch.Generator(backend.device).manual_seed(7), None, None, torch.Generator(backend.device).manual_seed(8), None]
    assert ops.random_sample(probs, as_list, backend=backend)[[1, 4]].tolist() == first[[1, 4]].tolist()


def test_prefetched_noise_equals_drawing_now(backend, sampling_variant):
    probs = torch.rand(3, 200).to(backend.device)
    make = lambda: {0: torch.Generator(backend.device).manual_seed(3), 2: torch.Generator(backend.device).manual_seed(4)}  # noqa: E731
    now = ops.random_sample(probs, make(), backend=backend)
    generators = make()
    noise = ops.draw_sampling_noise(3, 200, generators, backend=backend)
    ahead = ops.random_sample(probs, generators, backend=backend, noise=noise)
    assert now[[0, 2]].tolist() == ahead[[0, 2]].tolist()
    assert noise.consumed
    with pytest.raises(ValueError, match="already used"):
        ops.random_sample(probs, generators, backend=backend, noise=noise)


def test_emulated_npu_draws_noise_on_the_side_stream_and_waits_on_its_event():
    npu = EmulatedNpuBackend()
    assert npu.sampling_noise_kind == NOISE_EXPONENTIAL
    entries = npu.side_stream_entries
    noise = ops.draw_sampling_noise(4, 100, backend=npu)
    assert npu.side_stream_entries == entries + 1
    assert isinstance(noise.event, EmulatedEvent) and noise.event.recorded and not noise.event.waited
    assert noise.shape == (4, 100) and (noise.values > 0).all()
    ops.random_sample(torch.rand(4, 100), backend=npu, noise=noise)
    assert noise.event.waited
    # Without prefetched noise the draw still goes through the side stream and its event.
    ops.random_sample(torch.rand(4, 100), backend=npu)
    assert npu.side_stream_entries == entries + 2


def test_cpu_noise_is_one_uniform_per_row():
    noise = ops.draw_sampling_noise(5, 1000, backend="cpu")
    assert noise.kind == NOISE_UNIFORM and noise.shape == (5,) and noise.values.dtype == torch.float64
    assert noise.event is None


def test_noise_mismatch_is_rejected():
    probs = torch.rand(4, 100)
    with pytest.raises(ValueError, match="shape"):
        ops.random_sample(probs, backend="cpu", noise=ops.draw_sampling_noise(3, 100, backend="cpu"))
    with pytest.raises(ValueError, match="'exponential' but backend 'cpu'"):
        ops.random_sample(probs, backend="cpu", noise=ops.draw_sampling_noise(4, 100, backend=EmulatedNpuBackend()))


def test_random_sample_validation():
    probs = torch.rand(3, 10)
    with pytest.raises(ValueError, match="row 3, outside"):
        ops.random_sample(probs, {3: torch.Generator()})
    with pytest.raises(ValueError, match=r"generators\[0\] must be a torch.Generator"):
        ops.random_sample(probs, {0: 42})
    with pytest.raises(ValueError, match="2 entries for 3 rows"):
        ops.random_sample(probs, [None, None])
    with pytest.raises(ValueError, match="2-D"):
        ops.random_sample(probs[0])
    assert ops.random_sample(torch.rand(0, 10)).shape == (0,)


def test_filter_validation_names_the_argument():
    logits = torch.randn(3, 10)
    with pytest.raises(ValueError, match=r"k must have shape \(3,\)"):
        ops.apply_top_k_top_p(logits, torch.tensor([1, 2]), None)
    with pytest.raises(ValueError, match="p must be an floating-point|p must be a floating-point"):
        ops.apply_top_k_top_p(logits, None, torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="k must be an integer"):
        ops.apply_top_k_top_p(logits, torch.tensor([1.0, 2.0, 3.0]), None)
    with pytest.raises(ValueError, match="temperature must have shape"):
        ops.apply_temperature(logits, torch.ones(2))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        ops.apply_min_p(logits.to(torch.int32), torch.zeros(3))


def test_temperature_keeps_greedy_rows_and_scales_the_others():
    logits = torch.tensor([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]])
    ops.apply_temperature(logits, torch.tensor([0.0, 0.5, 2.0]))
    assert logits.tolist() == [[1.0, 2.0], [2.0, 4.0], [0.5, 1.0]]


def test_min_p_keeps_tokens_within_the_ratio():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    ops.apply_min_p(logits, torch.tensor([0.5, 0.0]))
    assert torch.isinf(logits[0]).tolist() == [False, False, True, True]
    assert not torch.isinf(logits[1]).any()


def test_sampling_constraints_compose_temperature_and_filters(backend):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 64, generator=g)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.5, 0.3])
    k = torch.tensor([0, 5, 10, 64, 3])
    p = torch.tensor([1.0, 0.8, 0.5, 0.9, 1.0])
    expected = logits.clone() / torch.tensor([1.0, 0.7, 1.0, 1.5, 0.3]).unsqueeze(1)
    apply_top_k_top_p_reference(expected, k, p)
    got = ops.apply_sampling_constraints(*to_device((logits.clone(), temperature, k, p), backend.device), backend=backend)
    assert torch.equal(got.cpu(), expected)


def test_backends_report_their_sampling_kernels(backend):
    kernels = backend.kernels()
    assert "random_sample" in kernels and "top_k_top_p" in kernels
    # CUDA's v2 sampling kernel generates its noise from a per-row Philox seed (backends/variants.py)
    expected_noise = (NOISE_UNIFORM if backend.name == "cpu"
                      else NOISE_PHILOX if backend.fused_logit_sampling else NOISE_EXPONENTIAL)
    assert backend.sampling_noise_kind == expected_noise
