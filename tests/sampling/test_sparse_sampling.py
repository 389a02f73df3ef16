"""Sampling over tree candidates is sampling the masked full rows: greedy token for token (ties to
the smallest token id, as the dense argmax), logprobs equal, and random draws with temperature,
top-k, top-p and min-p distributed exactly as the dense path (chi-square, alpha 1e-6), with
per-request generators, on every backend."""
import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import logitgate
from logitgate import TreeDFA
from logitgate.backends.base import CandidateRows
from logitgate.backends.reference import apply_top_k_top_p_reference
from logitgate.sampling import Sampler, SamplingMetadata, SamplingParams, make_generator
from logitgate.sampling.sparse import Layout, sample_layouts
from logitgate.sampling.tree_sampling import sample_tree_step
from tests.helpers.devices import to_device
from tests.helpers.sampling_helpers import interpreted_triton

VOCAB = 200
FRACTIONS = [0.0, 0.05, 1.0]  # all dense, mixed (wide rows dense), all sparse


def dense_step(sampler, logits, tree, states, metadata):
    """The path every layout must match: mask the full rows with the tree's bitmask, sample them."""
    bitmask = logitgate.allocate_token_bitmask(logits.shape[0], logits.shape[1], device=tree.device)
    tree.fill_bitmask(states, bitmask)
    logitgate.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
    return sampler(logits, metadata)


@st.composite
def batches(draw):
    seqs = draw(st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=3), min_size=1, max_size=40))
    walks = draw(st.lists(st.tuples(st.sampled_from(seqs), st.integers(0, 3)), min_size=1, max_size=10))
    seed = draw(st.integers(0, 2**16))
    return seqs, walks, seed


@given(case=batches(), fraction=st.sampled_from(FRACTIONS), logprobs=st.sampled_from([None, 0, 3, 50]))
def test_greedy_is_the_dense_argmax_token_for_token(case, fraction, logprobs, backend):
    seqs, walks, seed = case
    tree = TreeDFA.from_sequences(seqs, end_token_id=0, vocab_size=VOCAB, device=backend, cache=False)
    states = torch.tensor([tree.walk((list(s) + [0])[:d]) for s, d in walks], device=tree.device)
    # Small integer logits: ties everywhere; the dense argmax takes the first (smallest) token.
    logits = torch.randint(-2, 2, (len(walks), VOCAB), generator=torch.Generator().manual_seed(seed)).float().to(tree.device)
    metadata = SamplingMetadata.from_params([SamplingParams(temperature=0, logprobs=logprobs)] * len(walks), device=tree.device)
    sampler = Sampler(backend=backend)
    want = dense_step(sampler, logits.clone(), tree, states, metadata)
    got = sample_tree_step(sampler, logits.clone(), tree, states, metadata, sparse_max_fraction=fraction)
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    for row, token in zip(states.tolist(), got.sampled_token_ids[:, 0].tolist()):
        assert token in tree.allowed(row)
    if logprobs is None:
        assert got.logprobs_tensors is None
        return
    g, w = got.logprobs_tensors, want.logprobs_tensors
    assert torch.equal(g.selected_token_ranks, w.selected_token_ranks)
    assert torch.equal(g.logprob_token_ids[:, 0], w.logprob_token_ids[:, 0])
    torch.testing.assert_close(g.logprobs, w.logprobs, rtol=0, atol=1e-6)  # -inf where a row has fewer tokens
    finite = torch.isfinite(w.logprobs[:, 1:])
    for i in range(len(walks)):  # top-n ids: allowed tokens with those logprobs (ties in any order)
        allowed = tree.allowed(int(states[i]))
        assert all(t in allowed for t in g.logprob_token_ids[i, 1:][finite[i]].tolist())


FILTERS = [
    dict(temperature=1.0),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.7, top_k=4),
    dict(temperature=1.3, top_k=6, top_p=0.8),
    dict(temperature=1.0, min_p=0.3),
    dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05),  # k past the allowed count
]
DRAWS = 20000


def expected_probs(logits_row, allowed, f):
    """The masked full row, filtered as the dense sampler filters it (the torch reference)."""
    z = torch.full_like(logits_row, float("-inf"))
    z[allowed] = logits_row[allowed]
    z = (z / f["temperature"]).unsqueeze(0)
    k = torch.tensor([f.get("top_k", 0)]) if "top_k" in f else None
    p = torch.tensor([f.get("top_p", 1.0)]) if "top_p" in f else None
    z = apply_top_k_top_p_reference(z, k, p)
    if "min_p" in f:
        probs = z.softmax(-1)
        z = z.masked_fill(probs < probs.max() * f["min_p"], float("-inf"))
    return z.softmax(-1)[0]


def _metadata(params, rows, min_p, device="cpu", generators=None):
    md = SamplingMetadata.from_params(params, device=device, generators=generators)
    return dataclasses.replace(md, min_p=torch.full((rows,), min_p, device=device) if min_p else None)


@pytest.mark.parametrize("fraction", [0.0, 1.0])
@pytest.mark.parametrize("f", FILTERS, ids=[str(f) for f in FILTERS])
def test_random_draws_follow_the_masked_distribution(f, fraction, backend, assert_distribution):
    if interpreted_triton(backend) and f != FILTERS[0]:
        pytest.skip("the interpreted top-k/top-p kernel is too slow for 20000 rows (test_sampling_distributions covers it)")
    g = torch.Generator().manual_seed(7)
    allowed = sorted((1 + torch.randperm(VOCAB - 1, generator=g)[:30]).tolist())
    tree = TreeDFA.from_sequences([[t] for t in allowed], end_token_id=0, vocab_size=VOCAB, device=backend, cache=False)
    row = torch.randn(VOCAB, generator=g) * 2
    params = SamplingParams(**{k: v for k, v in f.items() if k != "min_p"})
    torch.manual_seed(11)
    states = tree.initial_states(DRAWS)
    metadata = _metadata([params] * DRAWS, DRAWS, f.get("min_p"), tree.device)
    logits = row.expand(DRAWS, -1).clone().to(tree.device)
    out = sample_tree_step(Sampler(backend=backend), logits, tree, states, metadata, sparse_max_fraction=fraction)
    assert_distribution(out.sampled_token_ids[:, 0].cpu(), expected_probs(row, allowed, f))


def test_generators_reproduce_and_draw_exactly(backend, assert_distribution):
    if interpreted_triton(backend):
        pytest.skip("the interpreted top-p kernel is too slow for 4000 rows")
    g = torch.Generator().manual_seed(8)
    allowed = sorted((1 + torch.randperm(VOCAB - 1, generator=g)[:25]).tolist())
    tree = TreeDFA.from_sequences([[t] for t in allowed], end_token_id=0, vocab_size=VOCAB, device=backend, cache=False)
    row = torch.randn(VOCAB, generator=g)
    rows = 4000
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=r) for r in range(rows)]
    states = tree.initial_states(rows)

    def run():
        gens = {r: make_generator(r, tree.device) for r in range(rows)}
        md = SamplingMetadata.from_params(params, device=tree.device, generators=gens)
        logits = row.expand(rows, -1).clone().to(tree.device)
        return sample_tree_step(Sampler(backend=backend), logits, tree, states, md, sparse_max_fraction=1.0)

    first, second = run(), run()
    assert torch.equal(first.sampled_token_ids, second.sampled_token_ids)
    assert_distribution(first.sampled_token_ids[:, 0].cpu(), expected_probs(row, allowed, dict(temperature=1.0, top_p=0.9)))


def test_mixed_batch_rows_land_in_their_layouts():
    """Greedy and random rows, wide rows dense and narrow rows sparse, in one batch: greedy rows get
    the dense argmax, every row an allowed token, each seeded row its own reproducible draw."""
    wide = [[t, 150] for t in range(10, 140)]
    tree = TreeDFA.from_sequences(wide, end_token_id=0, vocab_size=VOCAB, cache=False)  # on the default device
    states = torch.tensor([0, tree.walk([10]), 0, tree.walk([11]), tree.walk([11, 150]), 0], device=tree.device)
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([0, 0, 1.0, 1.0, 0.5, 0.0])]
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3)).to(tree.device)

    def run(fraction):
        gens = {i: make_generator(i, tree.device) for i, p in enumerate(params) if p.temperature > 0}
        md = SamplingMetadata.from_params(params, device=tree.device, generators=gens)
        return sample_tree_step(Sampler(), logits.clone(), tree, states, md, sparse_max_fraction=fraction).sampled_token_ids[:, 0]

    mixed = run(0.3)  # the root (130 tokens) is dense, the rest sparse
    dense = run(0.0)
    for i in (0, 1, 5):
        assert mixed[i] == dense[i]
    assert torch.equal(mixed, run(0.3))
    for i, s in enumerate(states.tolist()):
        assert int(mixed[i]) in tree.allowed(s)


def test_layouts_must_cover_the_batch():
    with pytest.raises(ValueError, match="the layouts hold 1 rows for a batch of 2"):
        sample_layouts(Sampler(), [Layout([0], torch.zeros(1, 3))], SamplingMetadata.from_params([SamplingParams(temperature=0)] * 2), 2)


def test_sparse_layouts_refuse_logits_processors():
    from logitgate.sampling.processors import LogitsProcessors, MinP

    md = dataclasses.replace(SamplingMetadata.from_params([SamplingParams()]), logitsprocs=LogitsProcessors([MinP()]))
    layout = Layout(None, torch.zeros(1, 3), lambda c: c)
    with pytest.raises(ValueError, match="logits processors work on whole-vocabulary rows"):
        sample_layouts(Sampler(), [layout], md, 1)


def test_sample_candidates_draws_the_masked_softmax(backend, assert_distribution):
    """Uniforms spread over [0, 1): the fused draw is the inverse CDF of the filtered softmax of the
    row's candidates, as sampling the masked full row (chi-square)."""
    from logitgate.backends.reference import apply_top_k_top_p_reference

    g = torch.Generator().manual_seed(2)
    vocab, draws = 3000, 20000
    allowed = sorted(torch.randperm(vocab, generator=g)[:700].tolist())
    logits = torch.randn(1, vocab, generator=g) * 2
    n = draws
    rows = torch.zeros(n, dtype=torch.int64)
    starts, widths = torch.zeros(n, dtype=torch.int64), torch.full((n,), len(allowed))
    allow_tok = torch.tensor(allowed, dtype=torch.int32)
    temperature, top_k, top_p = torch.full((n,), 0.8), torch.full((n,), 300), torch.full((n,), 0.9)
    uniform = torch.rand(n, dtype=torch.float64, generator=g)
    candidates = CandidateRows(rows, starts, widths, allow_tok, len(allowed))
    args = to_device((logits, candidates, temperature, None, top_k, top_p, uniform), backend.device)
    got = backend.sample_candidates(*args)
    masked = torch.full((1, vocab), float("-inf"))
    masked[0, allowed] = logits[0, allowed] / 0.8
    expected = apply_top_k_top_p_reference(masked, top_k[:1], top_p[:1]).softmax(-1)[0]
    assert_distribution(got.cpu(), expected)


@pytest.mark.parametrize("f", FILTERS[:4], ids=[str(f) for f in FILTERS[:4]])
def test_fused_draws_use_the_samplers_random_numbers(f):
    """On CPU random rows over candidates take Backend.sample_candidates (sampling/tree_sampling.py:
    fused_plan): for the same seeds it draws the tokens the layouts + Sampler draw (the same
    uniforms, per-request generators and the default one, in the same order), with dense rows in
    the batch too; where a draw lands within rounding of a cumulative sum the two may differ."""
    from logitgate.sampling.tree_sampling import fused_plan, tree_layouts
    from logitgate.structured.tree.candidates import plan_tree_step

    g = torch.Generator().manual_seed(9)
    seqs = [[int(t) for t in torch.randint(1, VOCAB, (3,), generator=g)] for _ in range(150)]
    tree = TreeDFA.from_sequences(seqs, end_token_id=0, vocab_size=VOCAB, device="cpu", cache=False)  # the fused draw is the CPU's
    walks = [seqs[i][: i % 3] for i in range(24)]
    states = torch.tensor([tree.walk(w) for w in walks])
    logits = torch.randn(len(walks), VOCAB, generator=g) * 2
    params = [SamplingParams(**f) if i % 5 else SamplingParams(temperature=0) for i in range(len(walks))]
    agree = 0
    for trial, fraction in enumerate([1.0, 0.3, 1.0, 0.3] * 5):
        plan = plan_tree_step(tree, states, VOCAB, sparse_max_fraction=fraction)
        outs = []
        for fused in (True, False):
            gens = {i: make_generator(1000 * trial + i) for i in range(len(walks)) if i % 3 == 1 and i % 5}
            md = SamplingMetadata.from_params(params, generators=gens)
            torch.manual_seed(trial)
            if fused:
                outs.append(fused_plan(Sampler(), plan, logits.clone(), md))
            else:
                outs.append(sample_layouts(Sampler(), tree_layouts(plan, logits.clone()), md, len(walks)).sampled_token_ids[:, 0].long())
        agree += int(torch.equal(outs[0], outs[1]))
        for i, s in enumerate(states.tolist()):
            assert int(outs[0][i]) in tree.allowed(s)
    assert agree >= 19
    assert plan_tree_step(tree, states, VOCAB, sparse_max_fraction=0.3).dense is not None  # the mixed case was mixed


@pytest.mark.parametrize("f", FILTERS[1:4], ids=[str(f) for f in FILTERS[1:4]])
def test_mixed_dense_and_fused_rows_follow_the_masked_distribution(f, assert_distribution):
    """A batch with wide rows (dense, the Sampler) and narrow ones (the fused draw): each row's
    draws follow its masked distribution (chi-square)."""
    g = torch.Generator().manual_seed(12)
    wide = sorted((1 + torch.randperm(VOCAB - 1, generator=g)[:120]).tolist())
    tree = TreeDFA.from_sequences([[t, wide[0]] for t in wide], end_token_id=0, vocab_size=VOCAB, device="cpu", cache=False)
    row = torch.randn(VOCAB, generator=g) * 2
    rows = 12000
    states = torch.tensor([0 if i % 2 else tree.walk([wide[5]]) for i in range(rows)])
    md = SamplingMetadata.from_params([SamplingParams(**f)] * rows)
    torch.manual_seed(13)
    out = sample_tree_step(Sampler(), row.expand(rows, -1).clone(), tree, states, md, sparse_max_fraction=0.3)[0][:, 0]
    narrow_allowed = sorted(tree.allowed(int(states[0])))
    assert_distribution(out[1::2], expected_probs(row, wide, f))
    assert_distribution(out[0::2], expected_probs(row, narrow_allowed, f))



def test_fused_draw_uses_prefetched_uniforms_once():
    """One sparse group holding the batch draws with the uniforms prefetched for the step (as the
    Sampler would), marks them used, and refuses them a second time."""
    from logitgate.backends.base import NOISE_UNIFORM, SamplingNoise

    g = torch.Generator().manual_seed(14)
    allowed = sorted((1 + torch.randperm(VOCAB - 1, generator=g)[:40]).tolist())
    tree = TreeDFA.from_sequences([[t] for t in allowed], end_token_id=0, vocab_size=VOCAB, device="cpu", cache=False)
    logits = torch.randn(8, VOCAB, generator=g)
    states = tree.initial_states(8)
    uniform = torch.tensor([0.0, 0.999999, 0.5, 0.25, 0.75, 0.1, 0.9, 0.0], dtype=torch.float64)

    def metadata():
        md = SamplingMetadata.from_params([SamplingParams(temperature=1.0, top_p=0.9)] * 8)
        md.noise = SamplingNoise(NOISE_UNIFORM, uniform.clone())
        return md

    md = metadata()
    fused = sample_tree_step(Sampler(), logits.clone(), tree, states, md, sparse_max_fraction=1.0).sampled_token_ids
    assert md.noise.consumed
    columns = torch.tensor(allowed)
    layouts = sample_layouts(Sampler(), [Layout(None, logits[:, allowed].clone(), lambda c: columns[c])], metadata(), 8)
    assert torch.equal(fused, layouts.sampled_token_ids)
    assert len(set(fused[:, 0].tolist())) > 3  # the uniforms decided the draws
    with pytest.raises(ValueError, match="already used"):
        sample_tree_step(Sampler(), logits.clone(), tree, states, md, sparse_max_fraction=1.0)
