"""The reference decode loop: speculative decoding and forced tokens never change what is sampled."""

import pytest
import torch

from logitgate import TreeDFA
from logitgate.decode import Request, generate
from logitgate.sampling.params import SamplingParams
from tests.helpers.stat_helpers import chisquare_pvalue

V, EOS, ROOT = 12, 10, 11
PATHS = [[1, 2], [1, 3], [4], [4, 5, 6], [7], [1, 2, 8]]


class Bigram:
    """A 'model' whose next-token logits depend on the last token only: exact distributions are
    computable, and it is fast enough to decode thousands of sequences."""

    def __init__(self, seed: int, scale: float = 2.0) -> None:
        self.table = torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * scale

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table[input_ids]


TARGET, DRAFT = Bigram(0), Bigram(1)
# generate() decodes on the CPU here (its default device), so the trees are built there: a tree on
# another device than the logits is masked densely, never through the sparse tree step.
TREE = TreeDFA.from_sequences(PATHS, end_token_id=EOS, vocab_size=V, device="cpu")


def exact_distribution(model: Bigram, temperature: float = 1.0) -> dict[tuple, float]:
    """P(sequence) under the tree-constrained model, for every complete path (ending in EOS)."""
    out = {}
    def walk(state, last, prefix, p):
        allowed = TREE.allowed(state)
        logits = model.table[last] / temperature
        probs = torch.softmax(logits[allowed].double(), 0)
        for token, q in zip(allowed, probs.tolist()):
            if token == EOS:
                out[tuple(prefix + [EOS])] = p * q
            else:
                walk(TREE.step(state, token), token, prefix + [token], p * q)
    walk(TREE.root, ROOT, [], 1.0)
    return out


def run(n: int, seed: int, **kwargs):
    requests = [Request([ROOT], SamplingParams(temperature=1.0, max_tokens=8, seed=seed + i), tree=TREE) for i in range(n)]
    return generate(TARGET, requests, eos_token_id=EOS, **kwargs)


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"jump_forward": False},
        {"draft_model": DRAFT, "num_speculative_tokens": 3},
        {"draft_model": DRAFT, "num_speculative_tokens": 3, "jump_forward": False},
        {"ngram": 1, "num_speculative_tokens": 2},
        {"sparse_max_fraction": 0.0},
        {"draft_model": DRAFT, "num_speculative_tokens": 3, "sparse_max_fraction": 0.0},
    ],
    ids=["plain+forced", "plain", "draft+forced", "draft", "ngram", "plain-dense", "draft+forced-dense"],
)
def test_constrained_sampling_follows_the_exact_distribution(config):
    expected = exact_distribution(TARGET)
    result = run(3000, 1000, **config)
    counts = dict.fromkeys(expected, 0)
    for out in result.outputs:
        seq = tuple(out.token_ids)
        assert seq in counts, f"{seq} is not a tree path"
        counts[seq] += 1
    keys = sorted(expected)
    observed = [counts[k] for k in keys]
    exp = [expected[k] * len(result.outputs) for k in keys]
    assert chisquare_pvalue(observed, exp) > 1e-6
    if "draft_model" in config:
        assert result.stats.proposed_drafts > 0 and 0 < result.stats.acceptance_rate <= 1


def test_greedy_is_identical_with_and_without_speculation():
    requests = lambda: [Request([ROOT, t], SamplingParams(temperature=0.0, max_tokens=6)) for t in range(10)]  # noqa: E731
    plain = generate(TARGET, requests(), eos_token_id=EOS)
    for kwargs in ({"draft_model": DRAFT, "num_speculative_tokens": 4}, {"ngram": 1, "num_speculative_tokens": 3}):
        spec = generate(TARGET, requests(), eos_token_id=EOS, **kwargs)
        assert [o.token_ids for o in spec.outputs] == [o.token_ids for o in plain.outputs]
        assert spec.stats.target_forward_passes <= plain.stats.target_forward_passes
    # Unconstrained greedy is argmax of the bigram table, step by step.
    for out, t in zip(plain.outputs, range(10)):
        last = t
        for token in out.token_ids:
            assert token == int(TARGET.table[last].argmax())
            last = token


@pytest.mark.parametrize("spec", [{}, {"draft_model": DRAFT, "num_speculative_tokens": 3}, {"ngram": 1, "num_speculative_tokens": 2}])
def test_tree_steps_sparse_and_dense_emit_the_same_greedy_tokens(spec):
    """Sampling and verifying over the tree's candidates (the default here) or over the masked
    vocabulary (crossover 0): the same tokens, step for step, ties included."""
    tied = Bigram(5)
    tied.table = tied.table.round()  # integer logits: ties between allowed tokens break to the smallest id
    requests = [Request([ROOT], SamplingParams(temperature=0.0, max_tokens=8), tree=TREE) for _ in range(3)]
    requests += [Request([ROOT, 1], SamplingParams(temperature=0.0, max_tokens=8), tree=TREE)]  # other first logits
    sparse = generate(tied, requests, eos_token_id=EOS, **spec)
    dense = generate(tied, requests, eos_token_id=EOS, sparse_max_fraction=0.0, **spec)
    assert [o.token_ids for o in sparse.outputs] == [o.token_ids for o in dense.outputs]
    assert "tree_step" in sparse.stats.seconds


def test_forced_tokens_are_emitted_without_target_passes():
    tree = TreeDFA.from_sequences([[3, 4, 5, 6, 7]], end_token_id=EOS, vocab_size=V, device="cpu")
    req = [Request([ROOT], SamplingParams(temperature=1.0, max_tokens=10, seed=0), tree=tree)]
    with_forced = generate(TARGET, req, eos_token_id=EOS)
    assert with_forced.outputs[0].token_ids == [3, 4, 5, 6, 7, EOS]
    # The end token after a completed path is forced too: all six tokens come from one target pass.
    assert with_forced.stats.target_forward_passes == 1 and with_forced.stats.forced_tokens == 6
    without = generate(TARGET, req, eos_token_id=EOS, jump_forward=False)
    assert without.outputs[0].token_ids == [3, 4, 5, 6, 7, EOS] and without.stats.target_forward_passes == 6


def test_seeds_reproduce_and_n_forks():
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=7, n=4)
    a = generate(TARGET, [Request([ROOT], params, tree=TREE)], eos_token_id=EOS, draft_model=DRAFT, num_speculative_tokens=2)
    b = generate(TARGET, [Request([ROOT], params, tree=TREE)], eos_token_id=EOS, draft_model=DRAFT, num_speculative_tokens=2)
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert [o.sample_index for o in a.outputs] == [0, 1, 2, 3]
    assert all(tuple(o.token_ids) in exact_distribution(TARGET) for o in a.outputs)


def test_stop_tokens_and_max_tokens():
    out = generate(TARGET, [Request([0], SamplingParams(temperature=0.0, max_tokens=3))], eos_token_id=None).outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    first = int(TARGET.table[0].argmax())
    out = generate(TARGET, [Request([0], SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[first]))], eos_token_id=None).outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"


def test_grammar_constraints_through_the_manager():
    xgrammar = pytest.importorskip("xgrammar")
    from logitgate.structured import StructuredOutputManager, StructuredOutputsParams

    vocab = [bytes([b]) for b in b"0123456789"] + [b"<eos>", b"<root>"]
    info = xgrammar.TokenizerInfo([v.decode("latin-1") for v in vocab], vocab_size=V, stop_token_ids=[EOS])
    manager = StructuredOutputManager(info, vocab_size=V, num_speculative_tokens=3)
    try:
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=3, structured_outputs=StructuredOutputsParams(regex="1[2-4]5?"))
        result = generate(TARGET, [Request([ROOT], params)] * 20, eos_token_id=EOS, manager=manager, draft_model=DRAFT, num_speculative_tokens=3)
        for out in result.outputs:
            text = "".join(str(t) for t in out.token_ids if t != EOS)
            assert text in {"12", "13", "14", "125", "135", "145"}, out.token_ids
            assert out.token_ids[-1] == EOS
    finally:
        manager.close()


@pytest.mark.parametrize(
    "request_, message",
    [
        (Request([ROOT], SamplingParams(min_p=0.1)), "min_p is not supported"),
        (Request([], SamplingParams()), "empty prompt"),
        (Request([ROOT], SamplingParams(max_tokens=None)), "max_tokens must be set"),
    ],
)
def test_bad_requests_are_named(request_, message):
    with pytest.raises(ValueError, match=message):
        generate(TARGET, [request_], eos_token_id=EOS)


def test_manager_must_allow_the_drafts():
    from logitgate.structured import StructuredOutputManager

    manager = StructuredOutputManager(vocab_size=V, num_speculative_tokens=1)
    try:
        with pytest.raises(ValueError, match="allows 1 drafts per step but num_speculative_tokens=3"):
            generate(TARGET, [], eos_token_id=EOS, manager=manager, draft_model=DRAFT, num_speculative_tokens=3)
    finally:
        manager.close()


def test_bad_options():
    with pytest.raises(ValueError, match="draft_model or ngram"):
        generate(TARGET, [], eos_token_id=EOS, draft_model=DRAFT, ngram=2)
    with pytest.raises(ValueError, match="no StructuredOutputManager"):
        from logitgate.structured import StructuredOutputsParams

        generate(TARGET, [Request([ROOT], SamplingParams(structured_outputs=StructuredOutputsParams(regex="1")))], eos_token_id=EOS)


# ---- batches mixing tree sequences with others (issue 11): tree rows sparse, the rest dense ----

OTHER_PATHS = [[2, 3], [2, 5, 6], [9]]
OTHER_TREE = TreeDFA.from_sequences(OTHER_PATHS, end_token_id=EOS, vocab_size=V, device="cpu")


def _manager(xgrammar):
    from logitgate.structured import StructuredOutputManager

    vocab = [bytes([b]) for b in b"0123456789"] + [b"<eos>", b"<root>"]
    info = xgrammar.TokenizerInfo([v.decode("latin-1") for v in vocab], vocab_size=V, stop_token_ids=[EOS])
    return StructuredOutputManager(info, vocab_size=V, num_speculative_tokens=3)


def _spy_tree_steps(monkeypatch) -> list:
    """Record (tree, sequences) of every tree_spec_step the loop makes."""
    import importlib

    generate_module = importlib.import_module("logitgate.decode.generate")  # the package exports the function
    calls, real = [], generate_module.tree_spec_step

    def spy(sampler, logits, tree, host_states, drafts, *args, **kwargs):
        calls.append((tree, len(drafts)))
        return real(sampler, logits, tree, host_states, drafts, *args, **kwargs)

    monkeypatch.setattr(generate_module, "tree_spec_step", spy)
    return calls


@pytest.mark.parametrize("spec", [{}, {"draft_model": DRAFT, "num_speculative_tokens": 3}, {"ngram": 1, "num_speculative_tokens": 2}])
def test_mixed_batches_decode_tree_rows_sparse_and_match_each_request_alone(spec, monkeypatch):
    """Two trees, a grammar and unconstrained sequences in one batch: the tree sequences go through
    the sparse tree step (grammar and free rows stay dense), and every sequence emits, token for
    token, what it emits decoded alone over the masked vocabulary (ties to the smallest id)."""
    xgrammar = pytest.importorskip("xgrammar")
    from logitgate.structured import StructuredOutputsParams

    tied = Bigram(5)
    tied.table = tied.table.round()  # integer logits: ties between allowed tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    grammar = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="1[2-4]5?"))
    requests = [
        Request([ROOT], greedy, tree=TREE), Request([ROOT, 3], greedy), Request([ROOT], grammar),
        Request([ROOT, 1], greedy, tree=OTHER_TREE), Request([ROOT, 1], greedy, tree=TREE), Request([ROOT], greedy, tree=OTHER_TREE),
    ]
    manager = _manager(xgrammar)
    try:
        calls = _spy_tree_steps(monkeypatch)
        mixed = generate(tied, requests, eos_token_id=EOS, manager=manager, **spec)
        assert {id(tree) for tree, _ in calls} == {id(TREE), id(OTHER_TREE)}
        assert all(n <= 2 for _, n in calls)  # only a tree's own sequences, never the grammar or free rows
        assert "masking" in mixed.stats.seconds and "tree_step" in mixed.stats.seconds
        alone = [generate(tied, [r], eos_token_id=EOS, manager=manager, sparse_max_fraction=0.0, **spec).outputs[0] for r in requests]
    finally:
        manager.close()
    assert [o.token_ids for o in mixed.outputs] == [o.token_ids for o in alone]
    assert [o.finish_reason for o in mixed.outputs] == [o.finish_reason for o in alone]
    for out, request in zip(mixed.outputs, requests):
        if request.tree is not None:
            assert out.token_ids[-1] == EOS and out.token_ids[:-1] in (PATHS if request.tree is TREE else OTHER_PATHS)


@pytest.mark.parametrize("spec", [{}, {"draft_model": DRAFT, "num_speculative_tokens": 3}], ids=["plain", "draft"])
def test_sampled_tree_rows_in_a_mixed_batch_follow_the_exact_distribution(spec, monkeypatch):
    """Tree sequences sampled (T=1) next to unconstrained and other-tree sequences: their paths
    follow the tree-constrained model exactly (chi-square, alpha 1e-6), through the sparse step."""
    calls = _spy_tree_steps(monkeypatch)
    n = 3000
    requests = [Request([ROOT], SamplingParams(temperature=1.0, max_tokens=8, seed=100 + i), tree=TREE) for i in range(n)]
    requests += [Request([ROOT, i % V], SamplingParams(temperature=1.0, max_tokens=3, seed=i)) for i in range(300)]
    requests += [Request([ROOT], SamplingParams(temperature=0.7, max_tokens=8), tree=OTHER_TREE) for _ in range(300)]
    result = generate(TARGET, requests, eos_token_id=EOS, **spec)
    assert any(id(tree) == id(TREE) for tree, _ in calls)
    expected = exact_distribution(TARGET)
    counts = dict.fromkeys(expected, 0)
    for out in result.outputs[:n]:
        seq = tuple(out.token_ids)
        assert seq in counts, f"{seq} is not a tree path"
        counts[seq] += 1
    keys = sorted(expected)
    assert chisquare_pvalue([counts[k] for k in keys], [expected[k] * n for k in keys]) > 1e-6
    for out in result.outputs[n + 300 :]:
        assert out.token_ids[-1] == EOS and out.token_ids[:-1] in OTHER_PATHS
