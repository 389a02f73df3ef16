"""The protocols are enough to plug in another engine: a small byte-level `choice` engine written
here, registered by name, routed to by the manager next to xgrammar."""
import pytest
import torch

from logitgate import token_ids_from_bitmask
from logitgate.structured import (
    BaseGrammarBackend,
    Grammar,
    GrammarBackend,
    RequestStatus,
    StructuredOutputManager,
    StructuredOutputsParams,
    available_grammar_backends,
    fill_bitmask_row,
    get_grammar_backend_factory,
    register_grammar_backend,
)
from tests.helpers.vocab_helpers import EOS, PERSON_SCHEMA, VOCAB_SIZE, plain_rows


class ByteChoiceGrammar:
    """The output is one of `choices`, one byte token at a time, then EOS."""

    def __init__(self, choices, vocab_size):
        self.choices, self.vocab_size, self.text = [c.encode() for c in choices], vocab_size, [b""]

    def _next(self, text):
        if text is None:
            return set()
        nxt = {c[len(text)] for c in self.choices if c.startswith(text) and len(c) > len(text)}
        return nxt | ({EOS} if text in self.choices else set())

    def _step(self, text, token):
        if token not in self._next(text):
            return False, text
        return True, (None if token == EOS else text + bytes([token]))

    def accept_tokens(self, tokens):
        text = self.text[-1]
        walked = []
        for t in tokens:
            ok, text = self._step(text, t)
            if not ok:
                return False
            walked.append(text)
        self.text.extend(walked)
        return True

    def validate_tokens(self, tokens):
        text, n = self.text[-1], 0
        for t in tokens:
            ok, text = self._step(text, t)
            if not ok:
                break
            n += 1
        return list(tokens[:n])

    def rollback(self, num_tokens):
        if not 0 <= num_tokens < len(self.text):
            raise ValueError(f"only {len(self.text) - 1} were accepted")
        del self.text[len(self.text) - num_tokens :]

    def fill_bitmask(self, bitmask, row):
        fill_bitmask_row(bitmask, row, sorted(self._next(self.text[-1])), self.vocab_size)

    def is_terminated(self):
        return self.text[-1] is None

    def reset(self):
        del self.text[1:]

    def fresh(self):
        return ByteChoiceGrammar([c.decode() for c in self.choices], self.vocab_size)


class ByteChoiceBackend(BaseGrammarBackend):
    name = "bytechoice"
    kinds = frozenset({"choice"})
    parallel_fill_threshold = 4  # exercise the thread-pool fill with small batches

    def __init__(self, tokenizer_info=None, *, vocab_size):
        super().__init__(vocab_size=vocab_size, fill_workers=2)

    def compile(self, kind, spec, *, disable_any_whitespace=False):
        if kind not in self.kinds:
            raise ValueError(f"bytechoice cannot compile {kind!r}")
        return ByteChoiceGrammar(spec, self.vocab_size)


register_grammar_backend("bytechoice", ByteChoiceBackend)


def test_registry_lists_and_refuses_duplicates():
    assert {"bytechoice", "tree", "xgrammar"} <= set(available_grammar_backends())
    assert get_grammar_backend_factory("bytechoice") is ByteChoiceBackend
    register_grammar_backend("bytechoice", ByteChoiceBackend)  # same factory again: fine
    with pytest.raises(ValueError, match="already registered"):
        register_grammar_backend("bytechoice", lambda **kw: None)
    with pytest.raises(ValueError, match="unknown grammar backend 'nope'; registered: .*xgrammar"):
        get_grammar_backend_factory("nope")
    with pytest.raises(ValueError, match="not callable"):
        register_grammar_backend("x", 3)


def test_protocols_hold_for_the_test_engine():
    backend = ByteChoiceBackend(vocab_size=VOCAB_SIZE)
    assert isinstance(backend, GrammarBackend)
    assert isinstance(backend.compile("choice", ["a"]), Grammar)


def test_preferred_engine_takes_its_kinds_and_xgrammar_the_rest(tokenizer_info, compiler):
    with StructuredOutputManager(
        tokenizer_info, vocab_size=VOCAB_SIZE, num_speculative_tokens=2, backend="bytechoice"
    ) as m:
        m.add_request("c", StructuredOutputsParams(choice=["ab", "ac", "b"]))
        m.add_request("j", StructuredOutputsParams(json=PERSON_SCHEMA))
        assert m.wait("c") is RequestStatus.READY and m.wait("j") is RequestStatus.READY
        bitmask = m.grammar_bitmask(["c", "j"], {"c": [ord("a"), ord("c")]})
        rows = token_ids_from_bitmask(bitmask, VOCAB_SIZE)
        assert rows[:3] == [[ord("a"), ord("b")], [ord("b"), ord("c")], [EOS]]
        assert torch.equal(bitmask[3:], plain_rows(compiler.compile_json_schema(PERSON_SCHEMA), [[]]))
        assert m.accept_tokens("c", [ord("b"), EOS]) and m.is_terminated("c")


def test_base_backend_fills_large_batches_on_its_thread_pool():
    backend = ByteChoiceBackend(vocab_size=VOCAB_SIZE)
    grammars = [backend.compile("choice", [chr(97 + i % 26) * 2]) for i in range(40)]
    rows = list(range(39, -1, -1))
    pooled, single = backend.allocate_token_bitmask(40), backend.allocate_token_bitmask(40)
    backend.fill_bitmasks(grammars, pooled, rows)
    for g, r in zip(grammars, rows):
        g.fill_bitmask(single, r)
    assert torch.equal(pooled, single)
    assert backend._fill_pool is not None
    backend.destroy()
    assert backend._fill_pool is None
