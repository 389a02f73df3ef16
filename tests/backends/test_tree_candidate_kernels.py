"""The tree-candidate kernels (gather each row's allowed logits; keep only them in place) and the
argmax kernel, on every backend, against the torch reference on random CSR tables and logits."""
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from logitgate.backends.base import CandidateRows
from logitgate.backends.reference import (
    candidate_argmax_reference,
    gather_candidate_logits_reference,
    keep_candidate_logits_reference,
)
from tests.helpers.devices import to_device

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def candidate_cases(draw):
    vocab = draw(st.integers(1, 300))
    n_states = draw(st.integers(1, 6))
    lists = [sorted(draw(st.sets(st.integers(0, vocab - 1), min_size=1, max_size=min(vocab, 40)))) for _ in range(n_states)]
    batch = draw(st.integers(1, 6))
    rows = draw(st.lists(st.integers(0, batch - 1), min_size=0, max_size=batch, unique=True))
    states = [draw(st.integers(0, n_states - 1)) for _ in rows]
    extra = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**16))
    return vocab, lists, batch, rows, states, extra, seed


def _tables(lists, states):
    starts_all = torch.tensor([0] + [len(r) for r in lists]).cumsum(0)[:-1]
    allow_tok = torch.tensor([t for r in lists for t in r], dtype=torch.int32)
    s = torch.tensor(states, dtype=torch.int64)
    widths = torch.tensor([len(lists[i]) for i in states], dtype=torch.int64)
    return starts_all[s] if len(states) else torch.zeros(0, dtype=torch.int64), widths, allow_tok


@given(case=candidate_cases(), dtype=st.sampled_from(DTYPES))
def test_gather_candidate_logits_matches_reference(case, dtype, backend):
    vocab, lists, batch, rows, states, extra, seed = case
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)).to(dtype)
    starts, widths, allow_tok = _tables(lists, states)
    width = (int(widths.max()) if len(rows) else 0) + extra
    rows_t = torch.tensor(rows, dtype=torch.int64)
    candidates = CandidateRows(rows_t, starts, widths, allow_tok, width)
    got = backend.gather_candidate_logits(*to_device((logits, candidates), backend.device)).cpu()
    want = gather_candidate_logits_reference(logits, rows_t, starts, widths, allow_tok, width)
    assert got.dtype == torch.float32 and got.shape == (len(rows), width)
    assert torch.equal(got, want)
    # The contract in plain Python.
    for i, (r, s) in enumerate(zip(rows, states)):
        allowed = lists[s]
        assert got[i, : len(allowed)].tolist() == logits[r, allowed].float().tolist()
        assert (got[i, len(allowed) :] == float("-inf")).all()


@given(
    case=candidate_cases(),
    dtype=st.sampled_from(DTYPES),
    specials=st.lists(st.sampled_from(["nan", "-inf", "inf", "-0"]), max_size=4),
)
def test_candidate_argmax_is_the_dense_argmax_of_the_masked_row(case, dtype, specials, backend):
    vocab, lists, batch, rows, states, extra, seed = case
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-2, 2, (batch, vocab), generator=g).float()  # small integers: ties everywhere
    values = {"nan": float("nan"), "-inf": float("-inf"), "inf": float("inf"), "-0": -0.0}
    for name in specials:
        logits[int(torch.randint(batch, (1,), generator=g)), int(torch.randint(vocab, (1,), generator=g))] = values[name]
    logits = logits.to(dtype)
    starts, widths, allow_tok = _tables(lists, states)
    width = (int(widths.max()) if len(rows) else 0) + extra
    rows_t = torch.tensor(rows, dtype=torch.int64)
    candidates = CandidateRows(rows_t, starts, widths, allow_tok, width)
    got = backend.candidate_argmax(*to_device((logits, candidates), backend.device)).cpu()
    want = candidate_argmax_reference(logits, rows_t, starts, widths, allow_tok, width)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    for i, (r, s) in enumerate(zip(rows, states)):  # the contract: argmax of the masked full row
        masked = torch.full((vocab,), float("-inf"))
        masked[lists[s]] = logits[r, lists[s]].float()
        assert int(got[i]) == int(masked.argmax())


@given(case=candidate_cases(), dtype=st.sampled_from(DTYPES))
def test_keep_candidate_logits_matches_reference(case, dtype, backend):
    vocab, lists, batch, rows, states, extra, seed = case
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)).to(dtype)
    starts, widths, allow_tok = _tables(lists, states)
    width = (int(widths.max()) if len(rows) else 0) + extra
    rows_t = torch.tensor(rows, dtype=torch.int64)
    got, want = logits.clone().to(backend.device), logits.clone()
    backend.keep_candidate_logits(got, to_device(CandidateRows(rows_t, starts, widths, allow_tok, width), backend.device))
    got = got.cpu()
    keep_candidate_logits_reference(want, rows_t, starts, widths, allow_tok, width)
    assert torch.equal(got, want)
    for r in range(batch):
        if r not in rows:
            assert torch.equal(got[r], logits[r])  # rows not listed are untouched
        else:
            allowed = lists[states[rows.index(r)]]
            expected = torch.full((vocab,), float("-inf"), dtype=dtype)
            expected[allowed] = logits[r, allowed]
            assert torch.equal(got[r], expected)


@given(
    rows=st.integers(1, 5),
    vocab=st.integers(1, 70),
    seed=st.integers(0, 2**16),
    specials=st.lists(st.sampled_from(["nan", "-nan", "-inf", "inf", "-0", "0", "tie"]), max_size=6),
)
def test_argmax_matches_torch(rows, vocab, seed, specials, backend):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 3, (rows, vocab), generator=g).float()  # small integers: many ties
    values = {"nan": float("nan"), "-nan": -float("nan"), "-inf": float("-inf"), "inf": float("inf"), "-0": -0.0, "0": 0.0}
    for name in specials:
        r, c = int(torch.randint(rows, (1,), generator=g)), int(torch.randint(vocab, (1,), generator=g))
        logits[r, c] = logits[r].max() if name == "tie" else values[name]
    assert torch.equal(backend.argmax(logits.to(backend.device)).cpu(), logits.argmax(dim=-1))


@pytest.mark.parametrize("value", [float("-inf"), -0.0, 0.0])
def test_argmax_of_constant_rows_is_the_first_index(value, backend):
    logits = torch.full((3, 1000), value)
    logits[1, 500] = -0.0 if value == 0.0 else value  # -0.0 == 0.0: still a tie
    assert backend.argmax(logits.to(backend.device)).tolist() == [0, 0, 0]


def test_argmax_wide_rows(backend):
    logits = torch.randn(4, 131072, generator=torch.Generator().manual_seed(3))
    logits[2, 7] = logits[2, 99999] = logits[2].max() + 1  # a tie at the top: the first wins
    assert torch.equal(backend.argmax(logits.to(backend.device)).cpu(), logits.argmax(dim=-1))


def _cdf_margin(values, top_k, top_p, temperature, greedy, uniform) -> float:
    """How close a draw of sample_candidates_reference comes to a rounding decision: the smallest
    distance of u * total to a cumulative sum, and of a top-p cut to the mass above a probability
    (float64). Kernels computing the softmax in another order may round across these."""
    from logitgate.backends.reference import apply_top_k_top_p_reference

    margin = float("inf")
    for i in range(values.shape[0]):
        if greedy is not None and bool(greedy[i]):
            continue
        z = values[i : i + 1].double() / float(temperature[i])
        if not torch.isfinite(z.max()):
            continue
        k = None if top_k is None else top_k[i : i + 1]
        z = apply_top_k_top_p_reference(z, k, None)
        probs = z.softmax(-1)[0]
        if top_p is not None and float(top_p[i]) < 1:
            above = (probs.unsqueeze(1) * (probs.unsqueeze(1) > probs.unsqueeze(0))).sum(0)
            margin = min(margin, float((above - float(top_p[i])).abs().min()))
            z = apply_top_k_top_p_reference(z, None, top_p[i : i + 1].double())
            probs = z.softmax(-1)[0]
        cdf = probs.cumsum(0)
        margin = min(margin, float((cdf - float(uniform[i]) * float(cdf[-1])).abs().min()))
    return margin


@given(
    case=candidate_cases(),
    dtype=st.sampled_from(DTYPES),
    filters=st.sampled_from(["none", "k", "p", "kp"]),
    mix=st.sampled_from(["random", "mixed"]),
    specials=st.lists(st.sampled_from(["nan", "-inf", "inf", "row-inf"]), max_size=3),
)
def test_sample_candidates_matches_reference(case, dtype, filters, mix, specials, backend):
    """Backend.sample_candidates (the CPU's fused kernel, the reference elsewhere) draws the
    reference's token for the same uniforms: temperature, top-k, top-p, greedy rows, rows without a
    distribution (fallback) and rows without candidates."""
    from logitgate.backends.reference import sample_candidates_reference

    vocab, lists, batch, rows, states, extra, seed = case
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=g) * 3).to(dtype)
    for name in specials:
        r, c = int(torch.randint(batch, (1,), generator=g)), int(torch.randint(vocab, (1,), generator=g))
        if name == "row-inf":
            logits[r] = float("-inf")
        else:
            logits[r, c] = {"nan": float("nan"), "-inf": float("-inf"), "inf": float("inf")}[name]
    starts, widths, allow_tok = _tables(lists, states)
    width = (int(widths.max()) if len(rows) else 0) + extra
    n = len(rows)
    rows_t = torch.tensor(rows, dtype=torch.int64)
    temperature = torch.rand(n, generator=g) * 1.5 + 0.2
    greedy = torch.rand(n, generator=g) < 0.3 if mix == "mixed" else None
    top_k = torch.randint(-1, width + 2, (n,), generator=g) if "k" in filters else None
    top_p = torch.rand(n, generator=g).clamp(min=0.05).masked_fill(torch.rand(n, generator=g) < 0.2, 1.0) if "p" in filters else None
    uniform = torch.rand(n, dtype=torch.float64, generator=g)
    values = gather_candidate_logits_reference(logits, rows_t, starts, widths, allow_tok, width)
    assume(_cdf_margin(values, top_k, top_p, temperature, greedy, uniform) > 1e-5)
    args = (rows_t, starts, widths, allow_tok, width, temperature, greedy, top_k, top_p, uniform)
    on_device = to_device(args, backend.device)
    got = backend.sample_candidates(logits.to(backend.device), CandidateRows(*on_device[:5]), *on_device[5:])
    want = sample_candidates_reference(logits, *args)
    assert got.dtype == torch.int64 and got.shape == (n,)
    assert torch.equal(got.cpu(), want)
    for i, s in enumerate(states):  # the contract: a candidate of the row (0 for a row without one)
        assert int(got[i]) in (lists[s] if lists[s] else [0])

