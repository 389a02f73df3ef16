"""rejection_sample: vLLM's behavioural cases, seeding, placeholders, safety and validation."""
import pytest
import torch

from logitgate.sampling import rejection as _rejection
from logitgate.sampling.rejection import MAX_SPEC_LEN, parse_output
from tests.helpers.devices import on_backend_device

# The tests build their inputs on the CPU; a call with backend= runs them on that backend's device.
rejection_sample = on_backend_device(_rejection.rejection_sample)
chain_speculative_sampling = on_backend_device(_rejection.chain_speculative_sampling)

VOCAB = 100


def target_logits_for(tokens, vocab=VOCAB):
    """Logits whose argmax (and nearly all probability) is the given token at each position."""
    logits = torch.full((len(tokens), vocab), -100.0)
    for row, token in enumerate(tokens):
        logits[row, token] = 100.0
    return logits


def run_greedy(spec, output, backend, **kwargs):
    """vLLM's test convention: `spec` = drafts per request, `output` = the target's tokens per
    position, whose last entry is the bonus token."""
    drafts = torch.tensor([t for s in spec for t in s], dtype=torch.int64)
    targets = [t for o, s in zip(output, spec) for t in o[: len(s)]]
    bonus = torch.tensor([o[-1] for o in output])
    return rejection_sample(drafts, [len(s) for s in spec], target_logits_for(targets), bonus, backend=backend, **kwargs)


# ---- greedy: vLLM's cases ----


@pytest.mark.parametrize(
    "spec, output, expected",
    [
        pytest.param([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]], id="perfect-match"),
        pytest.param([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5, -1, -1]], id="early-mismatch"),
        pytest.param([[1, 2], [3]], [[1, 2, 5], [3, 4]], [[1, 2, 5], [3, 4, -1]], id="multiple-sequences"),
        pytest.param([[1]], [[1, 2]], [[1, 2]], id="single-token"),
        pytest.param([[]], [[5]], [[5]], id="empty-sequence"),
        pytest.param(
            [[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 9]], [[1, 2, 7, -1], [4, 8, -1, -1]], id="multiple-mismatches"
        ),
        pytest.param(
            [[1, 2], [3, 4, 5, 6], [], [7]],
            [[1, 2, 9], [3, 8, 5, 6, 1], [2], [7, 3]],
            [[1, 2, 9, -1, -1], [3, 8, -1, -1, -1], [2, -1, -1, -1, -1], [7, 3, -1, -1, -1]],
            id="mixed-lengths",
        ),
        pytest.param([[0, 99]], [[0, 99, 98]], [[0, 99, 98]], id="vocab-boundaries"),
        pytest.param([[9, 9], [9]], [[1, 9, 4], [2, 3]], [[1, -1, -1], [2, -1, -1]], id="first-token-mismatch"),
    ],
)
def test_greedy_cases(backend, spec, output, expected, rejection_variant):
    out = run_greedy(spec, output, backend)
    assert out.dtype == torch.int32
    assert out.tolist() == expected


def test_zero_temperature_is_greedy_and_mixes_with_random(backend, rejection_variant):
    spec, output = [[1, 2, 3], [4, 5], [6]], [[1, 5, 3, 7], [4, 5, 8], [6, 9]]
    greedy = run_greedy(spec, output, backend)
    mixed = run_greedy(spec, output, backend, temperature=torch.tensor([0.0, 1.0, 0.0]))
    assert mixed[0].tolist() == greedy[0].tolist() and mixed[2].tolist() == greedy[2].tolist()
    # Request 1 samples at temperature 1, but its target is a near point mass on the drafts.
    assert mixed[1].tolist() == [4, 5, 8, -1]


def test_device_resident_temperature_runs_both_paths(backend, monkeypatch, rejection_variant):
    """When the temperature lives on a device the host cannot tell which requests are greedy
    without a sync: both kernels run, masked per request, with the same result."""
    from logitgate.sampling import rejection

    spec, output = [[1, 2, 3], [4, 5], [6, 2]], [[1, 5, 3, 7], [4, 5, 8], [6, 2, 9]]
    temperature = torch.tensor([0.0, 1.0, 0.0])
    expected = run_greedy(spec, output, backend, temperature=temperature)
    host_flags = rejection._check_temperature

    def as_if_on_device(*args):
        value, _, _ = host_flags(*args)
        return value, True, True

    monkeypatch.setattr(rejection, "_check_temperature", as_if_on_device)
    assert torch.equal(run_greedy(spec, output, backend, temperature=temperature), expected)
    assert expected.tolist() == [[1, 5, -1, -1], [4, 5, 8, -1], [6, 2, 9, -1]]


def test_random_rejection_emits_recovered_token_and_pads(backend, rejection_variant):
    # Draft probs put everything on the draft, the target gives it 0: always rejected; the
    # recovered token comes from max(target - draft, 0), which is the target here.
    logits = torch.full((2, 4), float("-inf"))
    logits[0, 2] = 0.0
    logits[1, 3] = 0.0
    draft_probs = torch.zeros(2, 4)
    draft_probs[:, 1] = 1.0
    out = rejection_sample(
        torch.tensor([1, 1]), [2], logits, torch.tensor([0]), draft_probs=draft_probs,
        temperature=torch.tensor([1.0]), backend=backend,
    )
    assert out.tolist() == [[2, -1, -1]]


def test_random_acceptance_of_certain_drafts(backend, rejection_variant):
    """target_p = 1 at every draft: all accepted whatever u is, then the bonus token."""
    out = run_greedy([[3, 7, 9]], [[3, 7, 9, 11]], backend, temperature=torch.tensor([0.8]))
    assert out.tolist() == [[3, 7, 9, 11]]
    out = rejection_sample(
        torch.tensor([3, 7]), [2], target_logits_for([3, 7]), torch.tensor([5]),
        draft_probs=torch.softmax(torch.randn(2, VOCAB), -1), temperature=torch.tensor([1.0]), backend=backend,
    )
    assert out.tolist() == [[3, 7, 5]]


@pytest.mark.parametrize("mode", ["greedy", "ngram", "draft_probs"])
def test_placeholder_drafts_are_always_rejected(backend, mode, rejection_variant):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, VOCAB, generator=g)
    logits[:, 0] = 50.0  # token 0 is the target's certain choice everywhere
    drafts = torch.tensor([0, -1, 0, -1, 0, 0])
    kwargs = {} if mode == "greedy" else {"temperature": torch.tensor([1.0, 1.0])}
    if mode == "draft_probs":
        kwargs["draft_probs"] = torch.softmax(torch.randn(6, VOCAB, generator=g), -1)
    out = rejection_sample(drafts, [3, 3], logits, torch.tensor([7, 7]), backend=backend, **kwargs)
    # The placeholder's slot gets the target's token (0), and nothing after it.
    assert out.tolist() == [[0, 0, -1, -1], [0, -1, -1, -1]]


def test_out_of_vocabulary_drafts_are_placeholders(backend, rejection_variant):
    for temperature in (None, torch.tensor([1.0])):
        out = rejection_sample(
            torch.tensor([VOCAB, 2**30]), [2], target_logits_for([4, 4]), torch.tensor([1]),
            temperature=temperature, backend=backend,
        )
        assert out.tolist() == [[4, -1, -1]]


def emitted_ids_are_safe(out, vocab):
    """Every row: ids in [0, vocab), then only -1, and at least one id."""
    for row in out.tolist():
        n = next((i for i, t in enumerate(row) if t == -1), len(row))
        assert n >= 1 and all(0 <= t < vocab for t in row[:n]) and all(t == -1 for t in row[n:]), row


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:divide by zero:RuntimeWarning")
@pytest.mark.parametrize("poison", ["nan", "neg_inf", "pos_inf", "nan_draft_probs", "zero_draft_probs", "huge"])
@pytest.mark.parametrize("mode", ["greedy", "random", "random_draft_probs"])
def test_degenerate_rows_never_emit_out_of_vocab_ids(backend, poison, mode, rejection_variant):
    """vLLM once emitted ids >= V for NaN target rows (a remote crash); here every id is valid."""
    vocab = 37  # not a power of two: padded lanes exist in every tile
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(8, vocab, generator=g)
    probs = torch.softmax(torch.randn(8, vocab, generator=g), -1)
    if poison == "nan":
        logits[:, :] = float("nan")
    elif poison == "neg_inf":
        logits[:, :] = float("-inf")
    elif poison == "pos_inf":
        logits[:, 5] = float("inf")
    elif poison == "nan_draft_probs":
        probs[:, :] = float("nan")
    elif poison == "zero_draft_probs":
        probs[:, :] = 0.0
    else:
        logits = logits * 1e30
    drafts = torch.randint(0, vocab, (8,), generator=g)
    kwargs = {}
    if mode != "greedy":
        kwargs["temperature"] = torch.tensor([1.0, 0.5])
    if mode == "random_draft_probs":
        kwargs["draft_probs"] = probs
    out = rejection_sample(drafts, [5, 3], logits, torch.tensor([1, 2]), backend=backend, **kwargs)
    emitted_ids_are_safe(out, vocab)


def test_seeded_requests_are_deterministic(backend, rejection_variant):
    g = torch.Generator().manual_seed(0)
    counts = [4, 3, 4]
    logits = torch.randn(11, 30, generator=g)
    probs = torch.softmax(logits + torch.randn(11, 30, generator=g), -1)
    drafts = torch.multinomial(probs, 1, generator=g).squeeze(-1)
    temperature = torch.tensor([1.0, 0.9, 1.1])

    def run(seed, global_seed):
        torch.manual_seed(global_seed)
        gens = {0: torch.Generator(backend.device).manual_seed(seed), 2: torch.Generator(backend.device).manual_seed(seed + 1)}
        return rejection_sample(
            drafts, counts, logits, torch.tensor([1, 2, 3]), draft_probs=probs, temperature=temperature,
            generators=gens, backend=backend,
        )

    first = [run(seed, global_seed=seed) for seed in range(12)]
    again = [run(seed, global_seed=1000 + seed) for seed in range(12)]  # the global RNG does not matter
    for a, b in zip(first, again):
        assert torch.equal(a[[0, 2]], b[[0, 2]])
    assert len({tuple(o[0].tolist()) for o in first}) > 1  # different seeds, different outcomes


def test_exponential_noise_is_drawn_on_the_side_stream():
    from logitgate.backends.emulated import EmulatedNpuBackend

    backend = EmulatedNpuBackend()
    assert backend.recovery_noise == "exponential"
    out = run_greedy([[1, 2]], [[1, 5, 3]], backend, temperature=torch.tensor([1.0]))
    assert out.tolist() == [[1, 5, -1]]
    assert backend.side_stream_entries == 1  # drawn off the main stream, joined with an event


def test_requests_without_drafts_draw_nothing_from_their_generator(backend, rejection_variant):
    gen = torch.Generator(backend.device).manual_seed(7)
    state = gen.get_state()
    out = rejection_sample(
        torch.tensor([1]), [0, 1], target_logits_for([1]), torch.tensor([4, 5]), temperature=torch.tensor([1.0, 1.0]),
        generators={0: gen}, backend=backend,
    )
    assert out.tolist() == [[4, -1], [1, 5]]
    assert torch.equal(gen.get_state(), state)


def test_temperature_applies_to_target_not_draft_probs(backend, rejection_variant):
    """At a low temperature the target sharpens to its argmax; the draft probs stay as given."""
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    probs = torch.tensor([[0.0, 1.0, 0.0]])  # always drafts token 1
    out = rejection_sample(
        torch.tensor([1]), [1], logits, torch.tensor([0]), draft_probs=probs, temperature=torch.tensor([0.01]),
        backend=backend,
    )
    assert out.tolist() == [[0, -1]]  # p(1) ~ e^-10 at T=0.01: rejected, recovered = token 0


def test_inputs_are_not_modified(backend, rejection_variant):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 20, generator=g)
    probs = torch.softmax(torch.randn(5, 20, generator=g), -1)
    drafts = torch.randint(0, 20, (5,), generator=g)
    copies = [t.clone() for t in (logits, probs, drafts)]
    logits, probs, drafts = (t.to(backend.device) for t in (logits, probs, drafts))
    rejection_sample(drafts, [2, 3], logits, torch.tensor([1, 2]), draft_probs=probs, temperature=torch.tensor([0.7, 0.0]), backend=backend)
    for original, copy in zip((logits, probs, drafts), copies):
        assert torch.equal(original.cpu(), copy)


def test_output_shape_and_bonus_layouts():
    out = rejection_sample(torch.tensor([1, 2]), [2, 0, 0], target_logits_for([1, 2]), torch.tensor([[3], [4], [5]]))
    assert out.tolist() == [[1, 2, 3], [4, -1, -1], [5, -1, -1]]
    assert rejection_sample(torch.zeros(0, dtype=torch.int64), [], torch.zeros(0, 5), torch.zeros(0, dtype=torch.int64)).shape == (0, 1)
    counts = torch.tensor([1, 1])  # a tensor of counts works too
    assert rejection_sample(torch.tensor([1, 2]), counts, target_logits_for([1, 2]), torch.tensor([3, 4])).tolist() == [[1, 3], [2, 4]]


def test_max_spec_len():
    n = MAX_SPEC_LEN
    out = rejection_sample(torch.ones(n, dtype=torch.int64), [n], target_logits_for([1] * n), torch.tensor([2]))
    assert out.shape == (1, n + 1) and out[0, -1] == 2
    with pytest.raises(ValueError, match="request 1 has 129 draft tokens; the maximum speculative length is 128"):
        rejection_sample(torch.ones(n + 2, dtype=torch.int64), [1, n + 1], target_logits_for([1] * (n + 2)), torch.tensor([2, 2]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_draft_tokens": [2, 2]}, "draft_token_ids has 3 tokens but num_draft_tokens sums to 4"),
        ({"num_draft_tokens": [2, -1, 2]}, r"num_draft_tokens\[1\] = -1"),
        ({"target_logits": torch.zeros(2, 10)}, "target_logits has 2 rows but there are 3 draft tokens"),
        ({"target_logits": torch.zeros(3, 10, dtype=torch.int32)}, "target_logits must be a 2-D float tensor"),
        ({"bonus_token_ids": torch.tensor([1, 2, 3])}, "bonus_token_ids must be an integer tensor of shape"),
        ({"bonus_token_ids": torch.tensor([1, 10])}, "bonus token 10 of request 1 is outside the vocabulary"),
        ({"draft_token_ids": torch.tensor([1.0, 2.0, 3.0])}, "draft_token_ids must be a 1-D integer tensor"),
        ({"draft_probs": torch.zeros(3, 11)}, "draft_probs has shape"),
        ({"temperature": torch.tensor([1.0, -0.5])}, "temperature -0.5 of request 1 must be finite and >= 0"),
        ({"temperature": torch.tensor([1.0])}, "temperature must be a float tensor of shape"),
        ({"temperature": [1.0, 1.0], "generators": {2: torch.Generator()}}, "generators has row 2, outside"),
        ({"temperature": [1.0, 1.0], "generators": {0: 5}}, r"generators\[0\] must be a torch.Generator, got int"),
        ({"top_k": torch.tensor([1.0, 2.0])}, "top_k must be an integer tensor"),
        ({"top_p": torch.tensor([0.5])}, r"top_p must be a 1-D tensor of shape \(2,\)"),
    ],
)
def test_bad_input_raises_value_error_naming_it(kwargs, message):
    args = {
        "draft_token_ids": torch.tensor([1, 2, 3]),
        "num_draft_tokens": [2, 1],
        "target_logits": torch.zeros(3, 10),
        "bonus_token_ids": torch.tensor([1, 2]),
    }
    args.update(kwargs)
    positional = [args.pop(k) for k in ("draft_token_ids", "num_draft_tokens", "target_logits", "bonus_token_ids")]
    with pytest.raises(ValueError, match=message):
        rejection_sample(*positional, **args)


def test_parse_output():
    out = torch.tensor([[1, 2, -1], [5, -1, -1], [7, 200, 3]], dtype=torch.int32)
    assert parse_output(out, vocab_size=100) == [[1, 2], [5], [7, 3]]


def test_top_k_top_p_reach_the_target():
    ops = pytest.importorskip("logitgate.sampling.ops", reason="sampling/ops.py lands on another branch")
    assert hasattr(ops, "apply_top_k_top_p")
    # top_k = 1 makes the target its argmax: a draft of the second-best token is always rejected.
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0], [3.0, 2.9, 0.0, 0.0]])
    for _ in range(20):
        out = rejection_sample(
            torch.tensor([1, 1]), [1, 1], logits, torch.tensor([2, 2]), temperature=torch.tensor([1.0, 1.0]),
            top_k=torch.tensor([1, 4]), top_p=torch.tensor([1.0, 1.0]),
        )
        assert out[0].tolist() == [0, -1]


# ---- FlashInfer-style chain_speculative_sampling ----


def test_chain_speculative_sampling_flashinfer_example(backend, rejection_variant):
    draft_probs = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]])
    target_probs = torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]])
    out, accepted, emitted = chain_speculative_sampling(draft_probs, torch.tensor([[2, 1]]), target_probs, backend=backend)
    assert out.tolist() == [[2, 0, -1]]
    assert accepted.tolist() == [1] and emitted.tolist() == [1]


def test_chain_speculative_sampling_accumulates_and_samples_bonus(backend, rejection_variant):
    target = torch.zeros(2, 3, 5)
    target[:, :, 4] = 1.0  # the target always says 4
    draft = torch.full((2, 2, 5), 0.2)
    acc_total = torch.tensor([10, 0], dtype=torch.int32, device=backend.device)  # updated in place
    emitted_total = torch.zeros(2, dtype=torch.int64, device=backend.device)
    gen = torch.Generator(backend.device).manual_seed(0)
    out, acc, emitted = chain_speculative_sampling(
        draft, torch.tensor([[4, 4], [4, 1]]), target, acc_total, emitted_total, generator=gen, backend=backend
    )
    assert out.tolist() == [[4, 4, 4], [4, 4, -1]]
    assert acc is acc_total and acc.tolist() == [12, 1]
    assert emitted is emitted_total and emitted.tolist() == [2, 1]
    with pytest.raises(ValueError, match="shapes disagree"):
        chain_speculative_sampling(draft, torch.tensor([[4, 4]]), target)
