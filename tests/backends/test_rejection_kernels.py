"""Every backend's rejection kernels against the torch reference, on random inputs."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from logitgate.backends import reference as R
from logitgate.backends.base import NOISE_PHILOX
from logitgate.backends.cpu.rejection_kernels import exp_nonpositive
from logitgate.backends.sampling_rules import PHILOX_SEED_HIGH
from logitgate.backends.triton.launch import ascend_grid_and_block
from tests.helpers.devices import to_device
from tests.helpers.sampling_helpers import near_decision

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def spec_cases(draw):
    counts = draw(st.lists(st.integers(0, 5), min_size=1, max_size=6))
    vocab = draw(st.sampled_from([1, 2, 7, 64, 300, 1100]))
    dtype = draw(st.sampled_from(DTYPES))
    with_probs = draw(st.booleans())
    with_temperature = draw(st.booleans())
    with_active = draw(st.booleans())
    masked = draw(st.sampled_from([0.0, 0.3, 0.95]))  # fraction of -inf logits (constraints, top-k)
    sharp = draw(st.sampled_from([0.5, 3.0, 12.0]))  # logit scale: flat to peaked
    seed = draw(st.integers(0, 2**31 - 1))
    return counts, vocab, dtype, with_probs, with_temperature, with_active, masked, sharp, seed


def make_case(counts, vocab, dtype, with_probs, with_temperature, with_active, masked, sharp, seed):
    g = torch.Generator().manual_seed(seed)
    n, b = sum(counts), len(counts)
    logits = torch.randn(n, vocab, generator=g) * sharp
    logits[torch.rand(n, vocab, generator=g) < masked] = float("-inf")
    logits[:, 0] = torch.where(torch.isinf(logits).all(-1), 0.0, logits[:, 0])  # keep rows non-empty
    logits = logits.to(dtype)
    probs = torch.softmax(logits.float() + torch.randn(n, vocab, generator=g), -1) if with_probs else None
    # Drafts: mostly the target argmax (so requests get past position 0), some random, some placeholders.
    drafts = logits.float().argmax(-1) if n else torch.zeros(0, dtype=torch.int64)
    pick = torch.rand(n, generator=g)
    drafts = torch.where(pick < 0.3, torch.randint(0, vocab, (n,), generator=g), drafts)
    drafts = torch.where(pick > 0.93, torch.tensor([-1, vocab])[torch.randint(0, 2, (n,), generator=g)], drafts)
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    temperature = (torch.rand(n, generator=g) * 1.5 + 0.25) if with_temperature else None
    active = (torch.rand(b, generator=g) < 0.7) if with_active else None
    uniform = torch.rand(n, dtype=torch.float64, generator=g)
    return cu, drafts, logits, probs, temperature, active, uniform, g


@given(case=spec_cases())
def test_greedy_accept_matches_reference(backend, case):
    cu, drafts, logits, _, _, active, _, _ = make_case(*case)
    expected = R.rejection_greedy_accept_reference(cu, drafts, logits, active)
    got = backend.rejection_greedy_accept(*to_device((cu, drafts, logits, active), backend.device))
    assert torch.equal(got[0].cpu(), expected[0])
    assert torch.equal(got[1].cpu(), expected[1])


@given(case=spec_cases())
def test_random_accept_matches_reference(backend, case):
    cu, drafts, logits, probs, temperature, active, uniform, _ = make_case(*case)
    acc_ref, lse_ref = R.rejection_random_accept_reference(cu, drafts, logits, temperature, probs, uniform, active)
    acc, lse = backend.rejection_random_accept(*to_device((cu, drafts, logits, temperature, probs, uniform, active), backend.device))
    acc, lse = acc.cpu(), lse.cpu()
    if not torch.equal(acc, acc_ref):
        # Only a draft whose ratio target_p / draft_p ties its uniform to float precision may differ.
        borderline = near_decision(cu, drafts, logits, temperature, probs, uniform)
        ends = cu.tolist()
        for r, (a, b) in enumerate(zip(acc.tolist(), acc_ref.tolist())):
            if a != b:
                start = ends[r - 1] if r else 0
                assert borderline[start + min(a, b)], f"request {r}: accepted {a} vs reference {b}"
        return
    assert torch.allclose(lse, lse_ref, rtol=1e-5, atol=1e-5)


# Residual mass max(p - q, 0) below this is float32 rounding noise (p and q each carry ~1e-7 error
# per token): the recovered distribution is undefined at that precision, and such a row is
# rejected with probability ~total anyway. Any in-vocabulary token is then a valid draw.
ROUNDING_MASS = 1e-5


def assert_valid_draw(token, needed, weights, noise, method):
    """The kernel's token is the reference draw up to float rounding: inside the inverse-CDF
    interval of u * total, or a maximiser of the race w / q."""
    w = weights.double()
    for r in range(w.shape[0]):
        t = int(token[r])
        if not needed[r] or not (w[r] > 0).any():
            assert t == 0
            continue
        if float(w[r].sum()) < ROUNDING_MASS:
            assert 0 <= t < w.shape[1], f"request {r}: token {t} outside the vocabulary"
            continue
        assert 0 <= t < w.shape[1] and w[r, t] > 0, f"request {r}: token {t} has no weight"
        if method == "uniform":
            cum = w[r].cumsum(0)
            needle = float(noise[r]) * float(cum[-1])
            low = float(cum[t] - w[r, t])
            tol = 1e-5 * float(cum[-1])
            assert low - tol <= needle <= float(cum[t]) + tol, f"request {r}: {needle} outside [{low}, {float(cum[t])}]"
        else:
            score = torch.where(w[r] > 0, w[r] / noise[r].double(), -1.0)
            assert score[t] >= score.max() * (1 - 1e-5)


@given(case=spec_cases(), accepted_from=st.sampled_from(["reference", "zero"]))
def test_recover_matches_reference(backend, case, accepted_from):
    cu, drafts, logits, probs, temperature, active, uniform, g = make_case(*case)
    accepted, row_lse = R.rejection_random_accept_reference(cu, drafts, logits, temperature, probs, uniform, active)
    if accepted_from == "zero":  # recover at every request's first draft
        accepted = torch.zeros_like(accepted)
        lse = R.tempered_logits(logits, temperature).logsumexp(-1)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), cu[:-1].long()])
        row_lse = lse[starts.clamp(max=max(lse.numel() - 1, 0))] if lse.numel() else row_lse
    b, vocab = cu.numel(), logits.shape[-1]
    seeds = None  # what the backend takes instead of the noise (CUDA v2)
    if backend.recovery_noise == "uniform":
        noise = torch.rand(b, dtype=torch.float64, generator=g)
        expected_fn = R.rejection_recover_inverse_cdf_reference
    elif backend.recovery_noise == NOISE_PHILOX:  # CUDA v2: a seed per request, the noise made in the kernel
        from logitgate.backends.triton.philox import philox_exponential_triton

        seeds = torch.randint(0, PHILOX_SEED_HIGH, (b,), dtype=torch.int64, generator=g)
        noise = philox_exponential_triton(seeds.to(backend.device), vocab).cpu()
        expected_fn = R.rejection_recover_exponential_reference
    else:
        noise = torch.empty(b, vocab).exponential_(generator=g)
        expected_fn = R.rejection_recover_exponential_reference
    needed, weights = R.recovery_weights_reference(cu, drafts, logits, temperature, probs, accepted, row_lse, active)
    expected = expected_fn(needed, weights, noise)
    args = to_device((cu, drafts, logits, temperature, probs, accepted, row_lse, noise if seeds is None else seeds, active),
                     backend.device)
    got = backend.rejection_recover(*args).cpu()
    assert got.dtype == torch.int32 and got.shape == (b,)
    if not torch.equal(got, expected):
        assert_valid_draw(got, needed, weights, noise, backend.recovery_noise)


def test_recovery_weights_semantics():
    """Residual with draft probs, target minus the draft for n-gram drafts, the target for a
    placeholder, the target again when nothing is left."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]))
    cu = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    drafts = torch.tensor([0, 1, -1, 2])
    probs = torch.tensor([[0.7, 0.1, 0.2], [0.1, 0.8, 0.1], [1.0, 0.0, 0.0], [0.5, 0.3, 0.2]])
    zeros = torch.zeros(4, dtype=torch.int32)
    lse = torch.zeros(4)
    _, w = R.recovery_weights_reference(cu, drafts, logits, None, probs, zeros, lse, None)
    assert torch.allclose(w[0], torch.tensor([0.0, 0.2, 0.0]), atol=1e-6)
    assert torch.allclose(w[1], torch.tensor([0.4, 0.0, 0.1]), atol=1e-6)
    assert torch.allclose(w[2], torch.tensor([0.5, 0.3, 0.2]), atol=1e-6)  # placeholder: the target
    assert torch.allclose(w[3], torch.tensor([0.5, 0.3, 0.2]), atol=1e-6)  # target == draft: the target
    _, w = R.recovery_weights_reference(cu, drafts, logits, None, None, zeros, lse, None)
    assert torch.allclose(w[1], torch.tensor([0.5, 0.0, 0.2]), atol=1e-6)  # n-gram: drop the draft


def test_greedy_argmax_follows_torch_on_nan_ties_and_infinities(backend):
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [1.0, nan, 5.0, nan], [-inf, -inf, -inf, -inf], [inf, 0.0, inf, 1.0]])
    cu = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    drafts = torch.tensor([2, 2, 1, 0])
    accepted, correction = backend.rejection_greedy_accept(*to_device((cu, drafts, logits), backend.device), None)
    assert accepted.tolist() == [0, 0, 0, 1]
    assert correction.tolist() == [1, 1, 0, 0]  # first max, first NaN, 0 for an all -inf row


def test_rows_after_a_rejection_do_not_matter(backend):
    """NaN rows after the first rejection change nothing (the lazy kernels never read them)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g)
    drafts = torch.tensor([int(logits[0].argmax()), int(logits[1].argmin()), 0, 0])
    cu = torch.tensor([4], dtype=torch.int32)
    poisoned = logits.clone()
    poisoned[2:] = float("nan")
    cu, drafts, logits, poisoned = to_device((cu, drafts, logits, poisoned), backend.device)
    assert torch.equal(backend.rejection_greedy_accept(cu, drafts, logits, None)[0], backend.rejection_greedy_accept(cu, drafts, poisoned, None)[0])


def test_fast_exp_is_accurate():
    import numpy as np

    x = np.linspace(-87.0, 0.0, 200001, dtype=np.float32)
    got = np.array([exp_nonpositive(v) for v in x[::50]], dtype=np.float64)
    exact = np.exp(x[::50].astype(np.float64))
    assert np.max(np.abs(got - exact) / exact) < 1e-6
    assert exp_nonpositive(np.float32(-np.inf)) == 0.0
    assert exp_nonpositive(np.float32(-100.0)) == 0.0
    assert np.isnan(exp_nonpositive(np.float32(np.nan)))


@pytest.mark.parametrize("batch, cores, expected", [(1, 48, (1, 1)), (48, 48, (48, 1)), (49, 48, (48, 2)), (64, 48, (48, 2)), (200, 48, (48, 8))])
def test_ascend_launch_covers_every_request(batch, cores, expected):
    grid, block = ascend_grid_and_block(batch, cores)
    assert (grid, block) == expected and grid * block >= batch
