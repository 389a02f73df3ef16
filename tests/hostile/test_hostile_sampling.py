"""Rows without a distribution (NaN, +inf, all -inf) and invalid top_p, on every backend.

The rule (backends/reference.py): a random row whose logits hold a NaN or a +inf, or nothing above
-inf, is sampled as its fallback token: the argmax with NaN ignored (first of ties), token 0 when
nothing is left. The expected tokens here are computed with plain Python, not the reference.
"""
import importlib.util
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from logitgate.sampling import Sampler, SamplingMetadata, SamplingParams, ops
from logitgate.sampling import rejection as _rejection
from tests.helpers.devices import on_backend_device, to_device
from tests.helpers.sampling_helpers import interpreted_triton

# Inputs are built on the CPU; a call with backend= runs them on that backend's device.
rejection_sample = on_backend_device(_rejection.rejection_sample)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None

NAN, INF = float("nan"), float("inf")
CORRUPTIONS = ["none", "all_nan", "one_nan", "all_neg_inf", "pos_inf", "two_pos_inf", "neg_inf_and_nan", "huge"]


def fallback(row: list[float]) -> int:
    best, token = -math.inf, 0
    for i, x in enumerate(row):
        if not math.isnan(x) and x > best:
            best, token = x, i
    return token


def corrupt(row: torch.Tensor, kind: str, data) -> None:
    vocab = row.numel()
    pick = lambda: data.draw(st.integers(0, vocab - 1))  # noqa: E731
    if kind == "all_nan":
        row.fill_(NAN)
    elif kind == "one_nan":
        row[pick()] = NAN
    elif kind == "all_neg_inf":
        row.fill_(-INF)
    elif kind == "pos_inf":
        row[pick()] = INF
    elif kind == "two_pos_inf":
        row[pick()] = INF
        row[pick()] = INF
    elif kind == "neg_inf_and_nan":
        row.fill_(-INF)
        row[pick()] = NAN
    elif kind == "huge":  # finite, but divided by a small temperature it overflows to +inf
        row[pick()] = 3e38


def undefined(row: list[float], temperature: float) -> bool:
    peak = max((x for x in row if not math.isnan(x)), default=-math.inf)
    return any(math.isnan(x) for x in row) or not math.isfinite(peak) or not math.isfinite(
        torch.tensor(peak, dtype=torch.float32).div(temperature).item()
    )


def test_issue_repro_nan_row_with_top_p_on_the_npu_path():
    lg = torch.randn(4, 100)
    lg[2] = NAN
    out = Sampler(backend="npu-emulated")(lg, SamplingMetadata.from_params([SamplingParams(temperature=1.0, top_p=0.9)] * 4))
    assert out.sampled_token_ids[2, 0].item() == 0


@settings(max_examples=25)
@given(data=st.data())
def test_sampler_rows_without_a_distribution_give_the_fallback_token(backend, data, sampling_variant):
    if interpreted_triton(backend):
        pytest.skip("the interpreted Triton kernels have their own, smaller test")
    check_sampler_rows(backend, data, max_rows=6, max_vocab=90)


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 and triton")
@settings(max_examples=6)
@given(data=st.data())
def test_sampler_rows_without_a_distribution_give_the_fallback_token_interpreted_triton(data):
    from logitgate.backends.emulated import EmulatedNpuBackend

    check_sampler_rows(EmulatedNpuBackend(triton_ascend=True, vector_cores=4), data, max_rows=3, max_vocab=40)


def check_sampler_rows(backend, data, *, max_rows, max_vocab):
    rows = data.draw(st.integers(1, max_rows))
    vocab = data.draw(st.integers(1, max_vocab))
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 2**16))))
    params = []
    for r in range(rows):
        corrupt(logits[r], data.draw(st.sampled_from(CORRUPTIONS)), data)
        params.append(
            SamplingParams(
                temperature=data.draw(st.sampled_from([0.0, 0.5, 1.0, 1e-3])),
                top_k=data.draw(st.sampled_from([0, 1, 3, vocab])),
                top_p=data.draw(st.sampled_from([1.0, 0.9, 0.3, 1e-6])),
            )
        )
    raw = logits.tolist()
    metadata = SamplingMetadata.from_params(params, device=backend.device)
    out = Sampler(backend=backend)(logits.to(backend.device), metadata).sampled_token_ids[:, 0].tolist()
    for r, (token, p) in enumerate(zip(out, params)):
        assert 0 <= token < vocab, (r, token)
        if p.temperature == 0.0:
            assert token == int(torch.tensor(raw[r]).argmax())  # greedy: torch.argmax, as vLLM
        elif undefined(raw[r], p.temperature):
            assert token == fallback(raw[r]), (r, raw[r])
        else:
            assert raw[r][token] > -INF


@settings(max_examples=25)
@given(data=st.data())
def test_random_sample_rows_without_a_total_give_the_fallback_token(backend, data, sampling_variant):
    rows, vocab = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 70))
    probs = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 2**16))))
    for r in range(rows):
        kind = data.draw(st.sampled_from(["none", "zero", "nan", "inf", "all_nan"]))
        if kind == "zero":
            probs[r] = 0.0
        elif kind == "nan":
            probs[r, data.draw(st.integers(0, vocab - 1))] = NAN
        elif kind == "inf":
            probs[r, data.draw(st.integers(0, vocab - 1))] = INF
        elif kind == "all_nan":
            probs[r] = NAN
    raw = probs.tolist()
    out = ops.random_sample(probs.to(backend.device), backend=backend).tolist()
    for r, token in enumerate(out):
        total = sum(raw[r])
        if not (math.isfinite(total) and total > 0):
            assert token == fallback(raw[r])
        else:
            assert 0 <= token < vocab and raw[r][token] > 0


@pytest.mark.parametrize("top_p", [None, 0.8])
@pytest.mark.parametrize("kind", ["all_nan", "one_nan", "all_neg_inf", "pos_inf"])
def test_rejection_rows_without_a_distribution_accept_and_recover_the_fallback(backend, kind, top_p, rejection_variant):
    vocab, gen = 50, torch.Generator().manual_seed(3)
    logits = torch.randn(4, vocab, generator=gen)
    for r in range(4):
        corrupt(logits[r], kind, _Fixed(r * 7 % vocab))
    expected = [fallback(row) for row in logits.tolist()]
    # Request 0 drafts its fallback twice (accepted), request 1 drafts something else (rejected).
    drafts = torch.tensor([expected[0], expected[1], (expected[2] + 1) % vocab, expected[3]])
    kwargs = dict(temperature=torch.tensor([1.0, 0.7]))
    if top_p is not None:
        kwargs["top_p"] = torch.tensor([top_p, top_p])
    out = rejection_sample(drafts, [2, 2], logits, torch.tensor([11, 12]), backend=backend, **kwargs).tolist()
    assert out[0] == [expected[0], expected[1], 11]
    assert out[1] == [expected[2], -1, -1]


def test_rejection_on_the_npu_path_from_the_environment(monkeypatch):
    monkeypatch.setenv("LOGITGATE_DEVICE", "npu-emulated")
    logits = torch.randn(2, 30)
    logits[0] = NAN
    out = rejection_sample(torch.tensor([5, 6]), [2], logits, torch.tensor([1]), temperature=torch.tensor([1.0]),
                           top_p=torch.tensor([0.9])).tolist()
    assert out[0][0] == 0  # draft 5 rejected: the NaN row recovers token 0


class _Fixed:
    """A stand-in for hypothesis' data object that always draws the same index."""

    def __init__(self, value):
        self.value = value

    def draw(self, _strategy):
        return self.value


def test_invalid_top_p_is_an_error_at_the_public_boundary():
    logits = torch.randn(3, 10)
    for bad in (0.0, -0.5, NAN):
        with pytest.raises(ValueError, match=r"p\[1\] = .* is not a valid top_p"):
            ops.apply_top_k_top_p(logits, None, torch.tensor([0.5, bad, 1.0]))
        with pytest.raises(ValueError, match=r"top_p\[1\] = .* is not a valid top_p"):
            rejection_sample(torch.tensor([1, 2]), [1, 1], torch.randn(2, 10), torch.tensor([0, 0]),
                             temperature=torch.tensor([1.0, 1.0]), top_p=torch.tensor([0.5, bad]))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


@pytest.mark.parametrize("p", [0.0, -1.0, NAN, 1e-9, 2.0])
def test_unchecked_top_p_values_mean_the_same_on_every_backend(backend, p):
    # What a device tensor (never read on the host) does: p <= 0 keeps the most likely tokens as the
    # smallest p does, NaN and p >= 1 leave the row alone.
    base = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    base[:, 5] = base[:, 6] = base.max() + 1  # a tie at the top
    got = backend.apply_top_k_top_p(base.to(backend.device), None, torch.full((3,), p, device=backend.device), None)
    kept = torch.isfinite(got).cpu()
    if math.isnan(p) or p >= 1:
        assert bool(kept.all())
    else:
        assert kept.sum(dim=1).tolist() == [2, 2, 2] and bool(kept[:, 5:7].all())


@settings(max_examples=20)
@given(data=st.data())
def test_rejection_kernels_on_rows_without_a_distribution_match_reference(backend, data, rejection_variant):
    from logitgate.backends import reference as R

    counts = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
    vocab = data.draw(st.sampled_from([1, 3, 40, 130]))
    n = sum(counts)
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 2**16))))
    for i in range(n):
        corrupt(logits[i], data.draw(st.sampled_from(CORRUPTIONS[1:-1])), data)
    temperature = torch.rand(n) + 0.5 if data.draw(st.booleans()) else None
    probs = torch.rand(n, vocab).softmax(-1) if data.draw(st.booleans()) else None
    tempered = logits if temperature is None else logits / temperature.unsqueeze(1)
    fallbacks = [fallback(row) for row in tempered.tolist()]
    drafts = torch.tensor([f if data.draw(st.booleans()) else (f + 1) % vocab if vocab > 1 else -1 for f in fallbacks],
                          dtype=torch.int64)
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    uniform = torch.rand(n, dtype=torch.float64)
    active = torch.tensor([data.draw(st.booleans()) for _ in counts]) if data.draw(st.booleans()) else None
    expected_accepted, expected_token, start = [], [], 0
    for r, c in enumerate(counts):
        a = 0
        while a < c and drafts[start + a] == fallbacks[start + a] and (probs is None or probs[start + a, fallbacks[start + a]] > 0):
            a += 1
        on = active is None or bool(active[r])
        expected_accepted.append(a if on else 0)
        expected_token.append(fallbacks[start + a] if on and a < c else 0)
        start += c
    for impl in (R, backend):
        if impl is backend:  # the backend's kernels take their inputs on its device
            cu, drafts, logits, temperature, probs, uniform, active = to_device(
                (cu, drafts, logits, temperature, probs, uniform, active), backend.device
            )
        accept = R.rejection_random_accept_reference if impl is R else backend.rejection_random_accept
        accepted, row_lse = accept(cu, drafts, logits, temperature, probs, uniform, active)
        assert accepted.tolist() == expected_accepted
        if impl is R:
            needed, weights = R.recovery_weights_reference(cu, drafts, logits, temperature, probs, accepted, row_lse, active)
            token = R.rejection_recover_exponential_reference(needed, weights, torch.ones_like(weights))
        else:
            noise = {"uniform": lambda: torch.rand(len(counts), dtype=torch.float64),
                     "philox": lambda: torch.randint(0, 2**62, (len(counts),))}.get(
                backend.recovery_noise, lambda: torch.empty(len(counts), vocab).exponential_())()
            noise = noise.to(backend.device)
            token = backend.rejection_recover(cu, drafts, logits, temperature, probs, accepted, row_lse, noise, active)
        assert token.tolist() == expected_token
