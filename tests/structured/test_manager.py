import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from logitgate.structured import (
    RequestStatus,
    StructuredOutputManager,
    StructuredOutputsParams,
    strip_speculative_padding,
)
from logitgate.structured.xgrammar_backend import XGrammarBackend
from tests.helpers.vocab_helpers import EOS, PERSON_SCHEMA, VOCAB_SIZE, encode, plain_rows, xgr

PERSON_TEXT = encode('{"name": "bob", "age": 42}')
ALL = torch.full((10,), -1, dtype=torch.int32)


@pytest.fixture
def manager(tokenizer_info):
    m = StructuredOutputManager(tokenizer_info, vocab_size=VOCAB_SIZE, num_speculative_tokens=4, max_workers=2)
    yield m
    m.close()


@pytest.fixture(scope="module")
def person(compiler):
    return compiler.compile_json_schema(PERSON_SCHEMA)


def reference_rows(compiled, prefix, drafts):
    """The contract, written against a plain xgrammar matcher: row k is the mask after k drafts;
    from the first rejected (or -1) draft on, rows repeat the last valid row; a terminated matcher
    allows everything."""
    matcher = xgr.GrammarMatcher(compiled)
    for t in prefix:
        assert matcher.accept_token(t)
    rows, alive = [], True
    for k in range(len(drafts) + 1):
        if not alive:
            rows.append(rows[-1].clone())
        elif matcher.is_terminated():
            rows.append(ALL.clone())
        else:
            one = xgr.allocate_token_bitmask(1, VOCAB_SIZE)
            matcher.fill_next_token_bitmask(one, 0)
            rows.append(one[0].to(torch.int32))
        if k < len(drafts) and alive and not matcher.is_terminated():
            t = drafts[k]
            alive = t != -1 and t < 300 and matcher.accept_token(t)  # ids >= 300 are padding: rejected
    return torch.stack(rows)


def add_ready(manager, request_id, **constraint):
    manager.add_request(request_id, StructuredOutputsParams(**constraint))
    assert manager.wait(request_id, timeout=30) is RequestStatus.READY, manager.error(request_id)


def test_rows_without_drafts_match_plain_xgrammar(manager, compiler, person):
    add_ready(manager, "json", json=PERSON_SCHEMA)
    add_ready(manager, "regex", regex=r"\d+-[ab]")
    add_ready(manager, "choice", choice=["yes", "no", "maybe"])
    add_ready(manager, "ebnf", grammar='root ::= "(" root ")" | "x"')
    advance = {"json": PERSON_TEXT[:5], "regex": encode("12"), "choice": encode("m"), "ebnf": encode("((")}
    for request_id, tokens in advance.items():
        assert manager.accept_tokens(request_id, tokens)
    order = ["ebnf", "json", "choice", "regex"]
    bitmask = manager.grammar_bitmask(order)
    expected = torch.cat([
        plain_rows(compiler.compile_grammar('root ::= "(" root ")" | "x"'), [advance["ebnf"]]),
        plain_rows(person, [advance["json"]]),
        plain_rows(compiler.compile_grammar('root ::= "yes" | "no" | "maybe"'), [advance["choice"]]),
        plain_rows(compiler.compile_regex(r"\d+-[ab]"), [advance["regex"]]),
    ])
    assert bitmask.dtype == torch.int32 and bitmask.shape == (4, 10)
    assert torch.equal(bitmask, expected)


def test_accepted_drafts_give_one_row_per_position_plus_bonus(manager, person):
    add_ready(manager, "r", json=PERSON_SCHEMA)
    assert manager.accept_tokens("r", PERSON_TEXT[:3])
    drafts = PERSON_TEXT[3:7]
    bitmask = manager.grammar_bitmask(["r"], {"r": drafts})
    prefixes = [PERSON_TEXT[: 3 + k] for k in range(5)]
    assert torch.equal(bitmask, plain_rows(person, prefixes))


def test_rows_after_a_rejected_draft_repeat_the_last_valid_row(manager, person):
    add_ready(manager, "r", json=PERSON_SCHEMA)
    good = PERSON_TEXT[:2]
    drafts = [good[0], good[1], ord("]"), PERSON_TEXT[2]]  # the third draft is invalid JSON here
    bitmask = manager.grammar_bitmask(["r"], {"r": drafts})
    valid = plain_rows(person, [[], good[:1], good])
    assert torch.equal(bitmask[:3], valid)
    assert torch.equal(bitmask[3], valid[2]) and torch.equal(bitmask[4], valid[2])
    padded = manager.grammar_bitmask(["r"], {"r": [good[0], -1, -1, -1]})
    assert torch.equal(padded[:2], valid[:2])
    assert all(torch.equal(padded[k], valid[1]) for k in (2, 3, 4))


NOISE = [-1, ord("}"), ord("x"), ord(","), EOS, 305]  # 305: a padding id past the tokenizer's vocabulary


@given(
    start=st.integers(0, len(PERSON_TEXT)),
    picks=st.lists(st.one_of(st.just("next"), st.sampled_from(NOISE)), max_size=4),
)
def test_rows_match_the_reference_and_state_is_unchanged(shared_manager, person, start, picks):
    # "next" drafts the true continuation at that position, so runs of accepted drafts are common.
    text = PERSON_TEXT + [EOS]
    drafts = [text[start + k] if p == "next" and start + k < len(text) else (EOS if p == "next" else p)
              for k, p in enumerate(picks)]
    request_id = f"h{start}-{drafts}"
    add_ready(shared_manager, request_id, json=PERSON_SCHEMA)
    try:
        assert shared_manager.accept_tokens(request_id, PERSON_TEXT[:start])
        before = shared_manager.grammar_bitmask([request_id])
        bitmask = shared_manager.grammar_bitmask([request_id], {request_id: drafts})
        assert torch.equal(bitmask, reference_rows(person, PERSON_TEXT[:start], drafts))
        assert torch.equal(shared_manager.grammar_bitmask([request_id]), before)
        assert shared_manager.validate_tokens(request_id, text[start:]) == text[start:]
    finally:
        shared_manager.remove_request(request_id)


@pytest.fixture(scope="module")
def shared_manager(tokenizer_info):
    shared = StructuredOutputManager(tokenizer_info, vocab_size=VOCAB_SIZE, num_speculative_tokens=4, max_workers=2)
    yield shared
    shared.close()


def test_terminated_grammar_rows_allow_everything(manager, compiler):
    add_ready(manager, "r", regex="a")
    bitmask = manager.grammar_bitmask(["r"], {"r": [ord("a"), EOS, ord("z")]})
    assert torch.equal(bitmask[:2], plain_rows(compiler.compile_regex("a"), [[], [ord("a")]]))
    assert torch.equal(bitmask[2], ALL) and torch.equal(bitmask[3], ALL)
    assert manager.accept_tokens("r", [ord("a"), EOS]) and manager.is_terminated("r")
    assert torch.equal(manager.grammar_bitmask(["r"])[0], ALL)
    assert not manager.accept_tokens("r", [ord("a")])


def test_mixed_draft_counts_lay_rows_out_request_after_request(manager, person, compiler):
    add_ready(manager, "a", json=PERSON_SCHEMA)
    add_ready(manager, "b", regex="[0-9]+")
    add_ready(manager, "c", choice=["yes", "no"])
    yes = [ord(c) for c in "yes"]
    spec = {"a": PERSON_TEXT[:2], "c": yes}
    bitmask = manager.grammar_bitmask(["a", "b", "c"], spec)
    assert bitmask.shape == (3 + 1 + 4, 10)
    assert torch.equal(bitmask[0:3], plain_rows(person, [[], PERSON_TEXT[:1], PERSON_TEXT[:2]]))
    assert torch.equal(bitmask[3:4], plain_rows(compiler.compile_regex("[0-9]+"), [[]]))
    choice = compiler.compile_grammar('root ::= "yes" | "no"')
    assert torch.equal(bitmask[4:8], plain_rows(choice, [yes[:k] for k in range(4)]))
    # A list aligned with request_ids works too.
    assert torch.equal(manager.grammar_bitmask(["a", "b", "c"], [spec["a"], [], spec["c"]]), bitmask)


def test_accept_validate_rollback_remove(manager):
    add_ready(manager, "r", regex="abc")
    assert manager.validate_tokens("r", [ord("a"), ord("x"), ord("c")]) == [ord("a")]
    assert not manager.accept_tokens("r", [ord("a"), ord("x")])
    assert manager.accept_tokens("r", [ord("a"), ord("b")])
    with pytest.raises(ValueError, match="only 2 were accepted"):
        manager.rollback("r", 3)
    manager.rollback("r", 1)
    assert manager.validate_tokens("r", [ord("b"), ord("c"), EOS, ord("a")]) == [ord("b"), ord("c"), EOS]
    assert not manager.is_terminated("r")
    manager.remove_request("r")
    manager.remove_request("r")  # unknown ids are ignored
    with pytest.raises(ValueError, match="'r' has no structured-output constraint"):
        manager.accept_tokens("r", [ord("a")])


def test_validate_draft_tokens_and_strip_padding(manager):
    add_ready(manager, "r", regex="ab*")
    out = manager.validate_draft_tokens({"r": [ord("a"), ord("b"), ord("c"), ord("b")], "plain": [5, 6]})
    assert out == {"r": [ord("a"), ord("b"), -1, -1], "plain": [5, 6]}
    assert strip_speculative_padding(out) == {"r": [ord("a"), ord("b")], "plain": [5, 6]}
    assert strip_speculative_padding([[1, -1, 3], [], [4]]) == [[1], [], [4]]


def test_a_failing_compile_fails_that_request_alone(manager, person):
    manager.add_request("bad", StructuredOutputsParams(regex="(unclosed"))
    manager.add_request("good", StructuredOutputsParams(json=PERSON_SCHEMA))
    assert manager.wait("bad", timeout=30) is RequestStatus.FAILED
    assert "parenthesis is not closed" in manager.error("bad")
    assert manager.wait("good", timeout=30) is RequestStatus.READY and manager.error("good") is None
    with pytest.raises(ValueError, match="'bad' has no usable constraint: invalid regex"):
        manager.grammar_bitmask(["good", "bad"], {"good": PERSON_TEXT[:2]})
    assert torch.equal(manager.grammar_bitmask(["good"]), plain_rows(person, [[]]))  # untouched by the failed call
    assert manager.accept_tokens("good", PERSON_TEXT)


def test_constraints_needing_a_tokenizer_fail_alone_without_one():
    with StructuredOutputManager(vocab_size=VOCAB_SIZE) as m:
        m.add_request("j", StructuredOutputsParams(json_object=True))
        assert m.wait("j", timeout=30) is RequestStatus.FAILED
        assert "needs tokenizer_info" in m.error("j")


def test_bad_batches_raise_before_touching_state(manager, person):
    add_ready(manager, "r", json=PERSON_SCHEMA)
    with pytest.raises(ValueError, match="5 draft tokens, more than num_speculative_tokens=4"):
        manager.grammar_bitmask(["r"], {"r": PERSON_TEXT[:5]})
    with pytest.raises(ValueError, match=f"token id {VOCAB_SIZE} of request 'r'"):
        manager.grammar_bitmask(["r"], {"r": [PERSON_TEXT[0], VOCAB_SIZE]})
    with pytest.raises(ValueError, match="duplicates"):
        manager.grammar_bitmask(["r", "r"])
    with pytest.raises(ValueError, match="'nope' has no structured-output constraint"):
        manager.grammar_bitmask(["r", "nope"], {"r": PERSON_TEXT[:2]})
    with pytest.raises(ValueError, match="2 entries for 1 request ids"):
        manager.grammar_bitmask(["r"], [[], []])
    with pytest.raises(ValueError, match="already registered"):
        manager.add_request("r", StructuredOutputsParams(regex="a"))
    with pytest.raises(ValueError, match="must be StructuredOutputsParams"):
        manager.add_request("s", {"regex": "a"})
    assert torch.equal(manager.grammar_bitmask(["r"]), plain_rows(person, [[]]))


def test_constructor_checks():
    with pytest.raises(ValueError, match="vocab_size"):
        StructuredOutputManager(vocab_size=0)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        StructuredOutputManager(vocab_size=8, num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="unknown grammar backend 'llguidance'"):
        StructuredOutputManager(vocab_size=8, backend="llguidance")
    with pytest.raises(ValueError, match="marker token id 9"):
        StructuredOutputManager(vocab_size=8, reasoning_end_token_ids=[9])


class CountingBackend(XGrammarBackend):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compiled: list[tuple] = []
        self._count_lock = threading.Lock()

    def compile(self, kind, spec, **kwargs):
        with self._count_lock:
            self.compiled.append((kind, spec))
        return super().compile(kind, spec, **kwargs)


def test_hundreds_of_concurrent_requests_compile_once_per_spec(tokenizer_info, compiler):
    engine = CountingBackend(tokenizer_info, vocab_size=VOCAB_SIZE)
    specs = [f"k{i}[a-c]+" for i in range(24)] + ["(bad", "[z-a]"]
    n_threads, per_thread = 6, 50  # 300 requests
    with StructuredOutputManager(tokenizer_info, vocab_size=VOCAB_SIZE, num_speculative_tokens=2,
                                 max_workers=4, backend=engine) as manager:
        barrier = threading.Barrier(n_threads)
        errors = []

        def submit(t):
            try:
                barrier.wait(timeout=10)
                for i in range(per_thread):
                    n = t * per_thread + i
                    manager.add_request(f"q{n}", StructuredOutputsParams(regex=specs[n % len(specs)]))
                    manager.status(f"q{n}")  # polling while others compile must not block
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=submit, args=(t,)) for t in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        assert not errors and not any(th.is_alive() for th in threads)
        ids = [f"q{n}" for n in range(n_threads * per_thread)]
        statuses = {r: manager.wait(r, timeout=60) for r in ids}
        failed = {r for r, s in statuses.items() if s is RequestStatus.FAILED}
        assert failed == {f"q{n}" for n in range(len(ids)) if n % len(specs) >= 24}
        assert sorted(spec for _, spec in engine.compiled) == sorted(specs)  # one compile per spec, failures too
        ready = [r for r in ids if r not in failed]
        drafts = {r: [ord("k")] + encode(str(int(r[1:]) % len(specs)))[:1] for r in ready}
        bitmask = manager.grammar_bitmask(ready, drafts)
        assert bitmask.shape == (3 * len(ready), 10)
        n = int(ready[7][1:]) % len(specs)
        row = 3 * 7
        prefixes = [[], [ord("k")], [ord("k")] + drafts[ready[7]][1:]]
        assert torch.equal(bitmask[row : row + 3], plain_rows(compiler.compile_regex(specs[n]), prefixes))


def test_end_to_end_mask_a_batch_with_drafts(manager, backend):
    """Manager rows, reordered into a batch that also holds an unconstrained request, applied to
    logits on every reachable device backend: each constrained row's argmax is a grammar token."""
    import logitgate

    add_ready(manager, "j", json=PERSON_SCHEMA)
    add_ready(manager, "c", choice=["yes", "no"])
    spec = {"j": PERSON_TEXT[:2], "free": [1, 2, 3], "c": [ord("n")]}
    bitmask = manager.grammar_bitmask(["c", "j"], spec)
    batch = ["j", "free", "c"]  # the model runner's order differs from the manager's
    logits = torch.randn(3 + 4 + 2, VOCAB_SIZE).to(backend.device)
    untouched = logits[3:7].clone()
    logitgate.apply_grammar_bitmask(logits, bitmask, ["c", "j"], batch, spec, backend=backend)
    allowed = logitgate.token_ids_from_bitmask(bitmask, VOCAB_SIZE)
    # manager rows: c -> 0, 1; j -> 2, 3, 4.   batch rows: j -> 0, 1, 2; free -> 3..6; c -> 7, 8
    for logit_row, manager_row in [(0, 2), (1, 3), (2, 4), (7, 0), (8, 1)]:
        assert int(logits[logit_row].argmax()) in allowed[manager_row]
        assert torch.isinf(logits[logit_row]).sum() == VOCAB_SIZE - len(allowed[manager_row])
    assert torch.equal(logits[3:7], untouched)


class FlakyBackend(XGrammarBackend):
    """Fails its first compile with a non-ValueError (as a crashed engine would)."""

    failed = False

    def compile(self, kind, spec, **kwargs):
        if not FlakyBackend.failed:
            FlakyBackend.failed = True
            raise MemoryError("out of memory while compiling")
        return super().compile(kind, spec, **kwargs)


def test_only_invalid_constraints_stay_cached_as_failures(tokenizer_info):
    engine = FlakyBackend(tokenizer_info, vocab_size=VOCAB_SIZE)
    with StructuredOutputManager(tokenizer_info, vocab_size=VOCAB_SIZE, backend=engine) as m:
        m.add_request("first", StructuredOutputsParams(regex="a+"))
        assert m.wait("first", timeout=30) is RequestStatus.FAILED
        assert m.error("first") == "out of memory while compiling"
        m.add_request("second", StructuredOutputsParams(regex="a+"))  # retried, not served the failure
        assert m.wait("second", timeout=30) is RequestStatus.READY


class GatedBackend(XGrammarBackend):
    """Compiles only once `gate` is set, so a test can look at a request mid-compile."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def compile(self, kind, spec, **kwargs):
        assert self.gate.wait(timeout=30)
        return super().compile(kind, spec, **kwargs)


def test_status_while_compiling_and_wait_timeout(tokenizer_info):
    from concurrent.futures import TimeoutError as FutureTimeoutError

    engine = GatedBackend(tokenizer_info, vocab_size=VOCAB_SIZE)
    with StructuredOutputManager(tokenizer_info, vocab_size=VOCAB_SIZE, backend=engine) as m:
        m.add_request("r", StructuredOutputsParams(regex="a"))
        assert m.status("r") is RequestStatus.COMPILING and not m.is_ready("r")
        assert m.error("r") is None and m.request_ids() == ["r"]
        with pytest.raises(FutureTimeoutError):
            m.wait("r", timeout=0.01)
        engine.gate.set()
        assert m.wait("r", timeout=30) is RequestStatus.READY and m.is_ready("r")
    with pytest.raises(ValueError, match="closed"):
        m.add_request("s", StructuredOutputsParams(regex="a"))


def test_sampling_params_field_is_the_managers_class(manager, person):
    """SamplingParams.structured_outputs is the very class the manager compiles (one class library-wide)."""
    from logitgate.sampling import SamplingParams
    from logitgate.sampling import StructuredOutputsParams as SamplingField

    assert SamplingField is StructuredOutputsParams
    params = SamplingParams(structured_outputs=SamplingField(json=PERSON_SCHEMA))
    manager.add_request("f", params.structured_outputs)
    assert manager.wait("f", timeout=30) is RequestStatus.READY
    assert torch.equal(manager.grammar_bitmask(["f"]), plain_rows(person, [[]]))
