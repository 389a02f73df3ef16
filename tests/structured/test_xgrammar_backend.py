import json
import random

import pytest
import torch

from logitgate import token_ids_from_bitmask
from logitgate.structured.grammar import Grammar, GrammarBackend
from logitgate.structured.registry import available_grammar_backends, get_grammar_backend_factory
from logitgate.structured.xgrammar_backend import XGrammarBackend, choice_ebnf, clean_xgrammar_error
from tests.helpers.real_tokenizers import real_tokenizer
from tests.helpers.vocab_helpers import EOS, PERSON_SCHEMA, VOCAB_SIZE, encode, plain_rows, xgr


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


# ---- real vocabularies: Llama-3 and Qwen2 (byte-level BPE), Llama-2 (SentencePiece, byte fallback) ----

REAL_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"enum": ["Europe/Berlin", "Asia/Tokyo"]}, "dst": {"type": "boolean"}},
    "required": ["zone", "dst"],
    "additionalProperties": False,
}
# Without optional whitespace (xgrammar then separates with ", " and ": ") the schema's language is
# these four strings, so the exact allowed set after any prefix follows from the token texts alone.
REAL_LANGUAGE = [
    f'{{"zone": "{zone}", "dst": {dst}}}'.encode() for zone in ("Europe/Berlin", "Asia/Tokyo") for dst in ("true", "false")
]


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes (byte-level BPE token strings), inverted: char -> byte."""
    direct = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in direct]
    return {**{chr(b): b for b in direct}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


def token_texts(tok, vocab_type) -> list[bytes | None]:
    """Each token's bytes, decoded from the token strings independently of xgrammar; None for
    special tokens (never allowed inside a grammar)."""
    special = {int(i) for i, t in tok.added_tokens_decoder.items() if t.special}
    byte_of = _byte_level_decoder()
    texts: list[bytes | None] = []
    for i, piece in enumerate(tok.convert_ids_to_tokens(list(range(len(tok))))):
        if i in special or piece is None:
            texts.append(None)
        elif vocab_type == xgr.VocabType.BYTE_LEVEL:
            texts.append(bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else piece.encode())
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            texts.append(bytes([int(piece[3:5], 16)]))  # SentencePiece byte fallback
        else:
            texts.append(piece.replace("▁", " ").encode())
    return texts


def expected_allowed(pieces: dict[int, bytes], prefix: bytes, stop_ids) -> list[int]:
    """The tokens whose text continues `prefix` inside the language; the stop tokens at its end."""
    rest = [s[len(prefix):] for s in REAL_LANGUAGE if s.startswith(prefix)]
    allowed = [i for i, t in pieces.items() if any(r.startswith(t) for r in rest)]
    return sorted(allowed + (list(stop_ids) if b"" in rest else []))


@pytest.mark.parametrize(
    "name, vocab_type",
    [("llama3", "BYTE_LEVEL"), ("qwen2", "BYTE_LEVEL"), ("llama2", "BYTE_FALLBACK")],
)
def test_real_vocabulary_json_bitmask_allows_exactly_the_right_tokens(name, vocab_type):
    tok = real_tokenizer(name)
    vocab_size = (len(tok) + 63) // 64 * 64  # embedding rows padded as models do
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
    assert info.vocab_type == getattr(xgr.VocabType, vocab_type)
    assert tok.eos_token_id in info.stop_token_ids
    texts = token_texts(tok, info.vocab_type)
    # Only a token whose text occurs inside the language can ever be allowed (keeps the steps fast).
    pieces = {i: t for i, t in enumerate(texts) if t and any(t in s for s in REAL_LANGUAGE)}
    backend = XGrammarBackend(info, vocab_size=vocab_size)
    try:
        grammar = backend.compile("json", REAL_SCHEMA, disable_any_whitespace=True)
        rng = random.Random(name)
        prefix, bitmask = b"", backend.allocate_token_bitmask(1)
        for _ in range(64):  # a random walk through the language, one token at a time
            grammar.fill_bitmask(bitmask, 0)
            allowed = token_ids_from_bitmask(bitmask, vocab_size)[0]
            assert allowed == expected_allowed(pieces, prefix, info.stop_token_ids), prefix
            if prefix in REAL_LANGUAGE:
                assert grammar.accept_tokens([tok.eos_token_id]) and grammar.is_terminated()
                break
            token = rng.choice([t for t in allowed if t not in info.stop_token_ids])
            assert grammar.accept_tokens([token])
            prefix += texts[token]
        else:
            pytest.fail(f"the walk did not finish: {prefix!r}")
    finally:
        backend.destroy()
