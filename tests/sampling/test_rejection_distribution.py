"""Distribution tests (chi-square, fixed seeds, alpha 1e-6): every emitted token follows the
(tempered / constrained) target, at the first position and at each later position given that the
output reached it — with and without draft probs, with placeholders, temperature, top-k/top-p and
a bitmask constraint. They run on the backends whose kernels are compiled (numba, the torch
reference, CUDA); the Triton kernels equal the reference draw for draw (tests/backends), and one
small run checks their distribution under the interpreter too."""
import os

import pytest
import torch

from logitgate.backends import get_backend, probe_cuda
from logitgate.backends.emulated import EmulatedNpuBackend
from logitgate.backends.reference import pack_bitmask
from logitgate.sampling import rejection, spec_constraint
from tests.helpers.devices import on_backend_device
from tests.helpers.stat_helpers import chisquare_pvalue

# Inputs are built on the CPU; a call with backend= runs them on that backend's device.
rejection_sample = on_backend_device(rejection.rejection_sample)
chain_speculative_sampling = on_backend_device(rejection.chain_speculative_sampling)
constrain_spec_logits = on_backend_device(spec_constraint.constrain_spec_logits)

ALPHA = 1e-6
VOCAB = 8
K = 3


SAMPLES = 12000


def _compiled_backends():
    backends = [get_backend("cpu"), EmulatedNpuBackend()]  # numba inverse CDF; reference exponential race
    if probe_cuda().available:
        backends.append(get_backend("cuda"))
    return backends


@pytest.fixture(params=_compiled_backends(), ids=lambda b: f"{b.name}-{b.recovery_noise}")
def backend(request):
    return request.param


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    counts = torch.bincount(tokens.long(), minlength=probs.numel()).double()
    assert counts.numel() == probs.numel(), f"{what}: token ids outside the vocabulary"
    support = probs > 0
    assert counts[~support].sum() == 0, f"{what}: tokens with zero target probability were emitted"
    expected = probs[support].double() * counts.sum() / probs[support].double().sum()
    p = chisquare_pvalue(counts[support].tolist(), expected.tolist())
    assert p > ALPHA, f"{what}: chi-square p = {p:.3g} (n = {int(counts.sum())})"


def accepted_counts(out: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Leading positions equal to the drafts (a correction never equals its rejected draft)."""
    match = (out[:, : drafts.shape[1]] == drafts).int()
    return match.cumprod(1).sum(1)


def check_every_position(out, drafts, target_probs, what):
    """Position 0 always; position j given the output reached it (j drafts accepted)."""
    reached = accepted_counts(out, drafts)
    for j in range(drafts.shape[1]):
        rows = reached >= j
        if rows.sum() >= 200:
            assert_follows(out[rows, j], target_probs[j], f"{what}, position {j}")
    assert (out >= -1).all() and (out < VOCAB).all()


def make_problem(seed: int, n: int, *, sharp: float = 1.5):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(K, VOCAB, generator=g) * sharp
    draft = torch.softmax(target + torch.randn(K, VOCAB, generator=g), -1)  # correlated, like a real drafter
    drafts = torch.stack([torch.multinomial(draft[j], n, replacement=True, generator=g) for j in range(K)], 1)
    return target, draft, drafts


def flat(target, draft, drafts):
    n = drafts.shape[0]
    return drafts.reshape(-1), target.repeat(n, 1), draft.repeat(n, 1)


@pytest.mark.parametrize("mode", ["draft_probs", "ngram", "placeholders"])
def test_emitted_tokens_follow_the_target(backend, mode, rejection_variant):
    torch.manual_seed(1234)
    n = SAMPLES
    target, draft, drafts = make_problem(7, n)
    if mode == "placeholders":
        drafts[torch.rand(drafts.shape, generator=torch.Generator().manual_seed(3)) < 0.2] = -1
    flat_drafts, logits, probs = flat(target, draft, drafts)
    out = rejection_sample(
        flat_drafts, [K] * n, logits, torch.zeros(n, dtype=torch.int64),
        draft_probs=None if mode == "ngram" else probs, temperature=torch.ones(n), backend=backend,
    ).cpu()
    check_every_position(out, drafts, torch.softmax(target, -1), mode)


def test_temperature_shapes_the_target_only(backend, rejection_variant):
    torch.manual_seed(99)
    n = SAMPLES
    target, draft, drafts = make_problem(8, n, sharp=1.0)
    flat_drafts, logits, probs = flat(target, draft, drafts)
    out = rejection_sample(
        flat_drafts, [K] * n, logits, torch.zeros(n, dtype=torch.int64), draft_probs=probs,
        temperature=torch.full((n,), 0.6), backend=backend,
    ).cpu()
    check_every_position(out, drafts, torch.softmax(target / 0.6, -1), "temperature 0.6")


def test_top_k_top_p_shape_the_target(backend, rejection_variant):
    ops = pytest.importorskip("logitgate.sampling.ops", reason="sampling/ops.py lands on another branch")
    torch.manual_seed(5)
    n = SAMPLES
    target, draft, drafts = make_problem(9, n, sharp=1.0)
    flat_drafts, logits, probs = flat(target, draft, drafts)
    temperature, top_k, top_p = 0.8, 5, 0.85
    out = rejection_sample(
        flat_drafts, [K] * n, logits, torch.zeros(n, dtype=torch.int64), draft_probs=probs,
        temperature=torch.full((n,), temperature), top_k=torch.full((n,), top_k), top_p=torch.full((n,), top_p),
        backend=backend,
    ).cpu()
    processed = ops.apply_top_k_top_p(target / temperature, torch.full((K,), top_k), torch.full((K,), top_p))
    check_every_position(out, drafts, torch.softmax(processed, -1), "top-k/top-p")


def test_constrained_target_under_a_bitmask(backend, rejection_variant):
    """Drafts from an unconstrained drafter; the masks allow a different subset at each position
    (one position forces a single token): emitted tokens follow the constrained target."""
    torch.manual_seed(77)
    n = SAMPLES
    target, draft, drafts = make_problem(10, n)
    allowed = torch.tensor(
        [[1, 1, 0, 1, 0, 1, 1, 0], [0, 1, 1, 1, 1, 0, 0, 1], [0, 0, 0, 0, 0, 0, 1, 0], [1, 0, 1, 0, 1, 0, 1, 0]], dtype=torch.bool
    )  # rows: the three draft positions, then the bonus position
    rows_per_request = torch.cat([target, torch.zeros(1, VOCAB)])  # drafts' target rows + a bonus row
    logits = rows_per_request.repeat(n, 1)
    bitmask = pack_bitmask(allowed).repeat(n, 1)
    flat_drafts = drafts.reshape(-1)
    constrained = constrain_spec_logits(logits, bitmask, flat_drafts, [K] * n, backend=backend)
    expected_valid = (allowed[torch.arange(K), drafts].int().cumprod(1).sum(1)).to(torch.int32)
    assert torch.equal(constrained.num_valid_drafts.cpu(), expected_valid)
    bonus = torch.multinomial(torch.softmax(constrained.bonus_logits, -1), 1).squeeze(-1)
    out = rejection_sample(
        flat_drafts, [K] * n, constrained.target_logits, bonus, draft_probs=flat(target, draft, drafts)[2],
        temperature=torch.ones(n), backend=backend,
    ).cpu()
    expected = torch.softmax(target.masked_fill(~allowed[:K], float("-inf")), -1)
    check_every_position(out, drafts, expected, "bitmask constraint")
    # Accepted drafts always satisfy the constraint: never more than the valid prefix.
    assert (accepted_counts(out, drafts) <= expected_valid).all()
    # The forced position (2) accepts its only allowed draft with probability 1.
    reached_forced = (accepted_counts(out, drafts) >= 2) & (drafts[:, 2] == 6)
    assert reached_forced.any() and (accepted_counts(out, drafts)[reached_forced] == K).all()


def test_chain_speculative_sampling_follows_the_target(backend, rejection_variant):
    torch.manual_seed(2024)
    n = SAMPLES
    target, draft, drafts = make_problem(11, n)
    bonus_target = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    target_probs = torch.softmax(torch.cat([target, bonus_target]), -1)
    out, _, emitted = chain_speculative_sampling(
        draft.expand(n, K, VOCAB), drafts, target_probs.expand(n, K + 1, VOCAB),
        generator=torch.Generator(backend.device).manual_seed(0), backend=backend,
    )
    out, emitted = out.cpu(), emitted.cpu()
    check_every_position(out, drafts, target_probs[:K], "chain")
    all_accepted = emitted == K
    if all_accepted.sum() >= 200:
        assert_follows(out[all_accepted, K], target_probs[K], "chain bonus")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_triton_kernels_sample_the_target_under_the_interpreter():
    backend = EmulatedNpuBackend(triton_ascend=True, vector_cores=4)
    torch.manual_seed(31)
    n = 200  # the interpreter runs each program in Python (~15 ms per request)
    target, draft, drafts = make_problem(12, n, sharp=0.7)
    flat_drafts, logits, probs = flat(target, draft, drafts)
    out = rejection_sample(
        flat_drafts, [K] * n, logits, torch.zeros(n, dtype=torch.int64), draft_probs=probs,
        temperature=torch.ones(n), backend=backend,
    )
    assert_follows(out[:, 0], torch.softmax(target[0], -1), "triton, position 0")
