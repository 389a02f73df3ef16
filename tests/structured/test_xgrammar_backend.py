import json

import pytest
import torch

from vocab_helpers import EOS, PERSON_SCHEMA, VOCAB_SIZE, encode, plain_rows
from logitgate.structured.grammar import Grammar, GrammarBackend
from logitgate.structured.registry import available_grammar_backends, get_grammar_backend_factory
from logitgate.structured.xgrammar_backend import XGrammarBackend, choice_ebnf, clean_xgrammar_error


@pytest.fixture(scope="module")
def engine(tokenizer_info):
    backend = XGrammarBackend(tokenizer_info, vocab_size=VOCAB_SIZE)
    yield backend
    backend.destroy()


def accepts(grammar, text: str) -> bool:
    return grammar.fresh().accept_tokens(encode(text))


def test_registered_and_satisfies_the_protocols(engine):
    assert "xgrammar" in available_grammar_backends()
    assert get_grammar_backend_factory("xgrammar") is XGrammarBackend
    assert isinstance(engine, GrammarBackend)
    assert isinstance(engine.compile("regex", "a"), Grammar)


@pytest.mark.parametrize(
    "kind, spec, good, bad",
    [
        ("json", PERSON_SCHEMA, '{"name": "bo", "age": 3}', '{"name": 3}'),
        ("json", json.dumps(PERSON_SCHEMA), '{"name": "", "age": -1}', '{"age": "x"}'),
        ("json_object", True, '{"anything": [1, 2, {"x": null}]}', "[1]"),
        ("regex", r"[a-c]{2}\d+", "ab12", "ad1"),
        ("grammar", 'root ::= "yes" | "no" | "(" root ")"', "((yes))", "(yes"),
        ("choice", ["maybe", 'a"b', "x\ny"], 'a"b', "may"),
        (
            "structural_tag",
            {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f>"],
             "tags": [{"begin": "<f>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}}, "end": "</f>"}]}},
            "hi <f>12</f>",
            "<f>x",
        ),
    ],
)
def test_every_kind_compiles_and_constrains(engine, kind, spec, good, bad):
    grammar = engine.compile(kind, spec)
    complete = grammar.fresh()
    assert complete.accept_tokens(encode(good) + [EOS]), good
    assert complete.is_terminated()
    prefix = grammar.fresh()
    assert not prefix.accept_tokens(encode(bad) + [EOS]), bad


def test_choice_ebnf_language_is_exactly_the_choices(engine):
    grammar = engine.compile("choice", ["ab", "abc", "\\"])
    for text in ["ab", "abc", "\\"]:
        g = grammar.fresh()
        assert g.accept_tokens(encode(text) + [EOS])
    assert not accepts(grammar, "abcd")
    assert choice_ebnf(['q"']) == 'root ::= "q\\""'


def test_disable_any_whitespace(engine):
    loose = engine.compile("json", PERSON_SCHEMA)
    compact = engine.compile("json", PERSON_SCHEMA, disable_any_whitespace=True)
    text = '{ "name": "a", "age": 1}'
    assert accepts(loose, text) and not accepts(compact, text)


def test_accept_is_all_or_nothing_and_validate_changes_nothing(engine, compiler):
    compiled = compiler.compile_json_schema(PERSON_SCHEMA)
    g = engine.compile("json", PERSON_SCHEMA)
    start = encode('{"name": "x"')
    assert g.accept_tokens(start)
    before = torch.full((1, 10), -1, dtype=torch.int32)
    g.fill_bitmask(before, 0)
    assert torch.equal(before, plain_rows(compiled, [start]))
    assert not g.accept_tokens(encode(', "age": 1x'))  # rejected at the x: nothing taken
    assert g.validate_tokens(encode(', "age": 12}q')) == encode(', "age": 12}')
    after = torch.full((1, 10), -1, dtype=torch.int32)
    g.fill_bitmask(after, 0)
    assert torch.equal(before, after)
    assert g.num_accepted_tokens == len(start)


def test_rollback_checks_depth_and_reset(engine):
    g = engine.compile("regex", "abc")
    assert g.accept_tokens([ord("a"), ord("b")])
    with pytest.raises(ValueError, match="only 2 were accepted"):
        g.rollback(3)
    g.rollback(1)
    assert g.validate_tokens([ord("b"), ord("c"), EOS]) == [ord("b"), ord("c"), EOS]
    g.reset()
    assert g.num_accepted_tokens == 0 and g.validate_tokens([ord("a")]) == [ord("a")]


def test_out_of_vocab_padding_and_terminated_tokens_are_rejected_quietly(engine):
    g = engine.compile("regex", "a")
    assert g.validate_tokens([VOCAB_SIZE]) == [] and g.validate_tokens([-1]) == []
    assert g.validate_tokens([300]) == []  # a padding id past the tokenizer's vocabulary
    assert g.accept_tokens([ord("a"), EOS]) and g.is_terminated()
    assert not g.accept_tokens([ord("a")])


@pytest.mark.parametrize(
    "kind, spec, reason",
    [
        ("regex", "(", "parenthesis is not closed"),
        ("json", "{not json", "Failed to parse JSON"),
        ("grammar", "root ::= ", "EBNF parser error"),
        ("structural_tag", "{}", ""),
    ],
)
def test_compile_errors_are_value_errors_with_the_reason(engine, kind, spec, reason):
    with pytest.raises(ValueError, match=f"invalid {kind} constraint: .*{reason}") as info:
        engine.compile(kind, spec)
    assert "/project/cpp" not in str(info.value)


def test_clean_error_strips_the_cpp_location():
    exc = RuntimeError("[00:32:31] /project/cpp/regex_converter.cc:83: Regex parsing error at position 2\nmore")
    assert clean_xgrammar_error(exc) == "Regex parsing error at position 2"


def test_constructor_errors(tokenizer_info):
    with pytest.raises(ValueError, match="needs tokenizer_info"):
        XGrammarBackend(None, vocab_size=VOCAB_SIZE)
    with pytest.raises(ValueError, match="tokenizer_info.vocab_size is 320 but vocab_size is 300"):
        XGrammarBackend(tokenizer_info, vocab_size=300)
    with pytest.raises(ValueError, match="cannot compile 'prefix_dict'"):
        XGrammarBackend(tokenizer_info, vocab_size=VOCAB_SIZE).compile("prefix_dict", {})


def test_batched_fill_equals_row_by_row(engine):
    grammars = [engine.compile("json", PERSON_SCHEMA) for _ in range(6)]
    text = encode('{"name": "bob", "age": 12}')
    for i, g in enumerate(grammars):
        assert g.accept_tokens(text[: 3 * i])
    rows = [5, 0, 3, 1, 4, 2]
    batched = engine.allocate_token_bitmask(6)
    engine.fill_bitmasks(grammars, batched, rows)
    single = engine.allocate_token_bitmask(6)
    for g, r in zip(grammars, rows):
        g.fill_bitmask(single, r)
    assert torch.equal(batched, single)
    assert batched.shape == (6, 10) and batched.dtype == torch.int32



def test_fork_is_an_independent_copy(engine):
    g = engine.compile("regex", "ab|ac")
    assert g.accept_tokens([ord("a")])
    twin = g.fork()
    assert twin.num_accepted_tokens == 1
    assert twin.accept_tokens([ord("b")]) and g.accept_tokens([ord("c")])
    rows = engine.allocate_token_bitmask(2)
    engine.fill_bitmasks([g, twin], rows, [0, 1])
    assert torch.equal(rows[0], rows[1])  # both complete: the stop token only
    g.rollback(1)
    twin.rollback(2)  # the twin's history is its own
    assert g.validate_tokens([ord("b"), EOS]) == [ord("b"), EOS]
    assert twin.validate_tokens([ord("a"), ord("c"), EOS]) == [ord("a"), ord("c"), EOS]
    assert g.num_accepted_tokens == 1 and twin.num_accepted_tokens == 0
