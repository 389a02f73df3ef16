"""structured/forced.py against real xgrammar (and llguidance where importable) with the real
Llama-3 tokenizer: what a constraint fixes next, mask-forced apart from string-forced."""
import json

import numpy as np
import pytest

from logitgate.structured.forced import (
    ForcedTokens,
    llguidance_forced_tokens,
    only_allowed_token,
    xgrammar_forced_tokens,
)
from tests.helpers.real_tokenizers import real_tokenizer

xgr = pytest.importorskip("xgrammar")

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"],
}


@pytest.fixture(scope="module")
def llama3():
    tok = real_tokenizer("llama3")
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    return tok, info, xgr.GrammarCompiler(info)


def _encode(tok):
    return lambda s: tok.encode(s, add_special_tokens=False)


def _texts(tok, ids):
    return [tok.decode([i]) for i in ids]


def test_json_schema_proposes_the_canonical_tokenization_of_the_fixed_string(llama3):
    tok, info, compiler = llama3
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(PERSON), any_whitespace=False, separators=(",", ":")))
    forced = xgrammar_forced_tokens(matcher, _encode(tok), 16, vocab_size=len(tok))
    assert tok.decode(forced.tokens) == '{"name":"'
    assert forced.tokens == tok.encode('{"name":"', add_special_tokens=False)
    assert forced.num_mask_forced == 0  # the mask also allows '{' alone: a draft to verify
    assert not matcher.is_terminated() and matcher.find_jump_forward_string() == '{"name":"'  # state unchanged


def test_every_proposal_is_accepted_in_sequence_and_the_matcher_is_left_as_it_was(llama3):
    tok, info, compiler = llama3
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(PERSON), any_whitespace=False, separators=(",", ":")))
    text = '{"name":"Vera","age":31,"tags":["dev"]}'
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    seen = []
    for token in ids:
        forced = xgrammar_forced_tokens(matcher, _encode(tok), 8, vocab_size=len(tok))
        probe = matcher.fork()
        assert all(probe.accept_token(t) for t in forced.tokens)
        seen.append(tok.decode(forced.tokens))
        assert matcher.accept_token(token)
    assert matcher.is_terminated()
    assert '","age":' not in seen and 'age":' in seen and 'tags":[' in seen


def test_the_stop_token_alone_is_mask_forced(llama3):
    tok, info, compiler = llama3
    matcher = xgr.GrammarMatcher(compiler.compile_regex("ab"))
    assert matcher.accept_string("ab")
    forced = xgrammar_forced_tokens(matcher, _encode(tok), 4, vocab_size=len(tok))
    assert forced.tokens == [tok.eos_token_id] and forced.num_mask_forced == 1
    # Without vocab_size nothing is claimed mask-forced: safe.
    assert xgrammar_forced_tokens(matcher, _encode(tok), 4).tokens == []


def test_a_grammar_that_ends_at_a_free_state_says_so(llama3):
    """`[a-z]+` may end after "ab" with many tokens allowed: nothing is proposed and ends_free tells
    the caller (vLLM's proposals) that asking again would cost a fill a step for nothing."""
    tok, info, compiler = llama3
    matcher = xgr.GrammarMatcher(compiler.compile_regex("[a-z]+"))
    assert matcher.accept_string("ab")
    forced = xgrammar_forced_tokens(matcher, _encode(tok), 4, vocab_size=len(tok))
    assert forced.tokens == [] and forced.ends_free
    closed = xgr.GrammarMatcher(compiler.compile_regex("ab"))
    assert closed.accept_string("ab")
    assert not xgrammar_forced_tokens(closed, _encode(tok), 4, vocab_size=len(tok)).ends_free  # the stop token alone
    assert not xgrammar_forced_tokens(matcher, _encode(tok), 4).ends_free  # no fill asked: nothing to say
    assert ForcedTokens([1, 2], 0, ends_free=True).cut(1).ends_free


def test_a_single_token_mask_then_a_string_counts_later_tokens_as_string_forced(llama3):
    tok, info, compiler = llama3
    matcher = xgr.GrammarMatcher(compiler.compile_regex("ab"))
    forced = xgrammar_forced_tokens(matcher, _encode(tok), 4, vocab_size=len(tok))
    assert tok.decode(forced.tokens) == "ab<|end_of_text|>"
    assert forced.num_mask_forced == 0 and forced.string_forced == forced.tokens


def test_regex_and_choice(llama3):
    tok, info, compiler = llama3
    matcher = xgr.GrammarMatcher(compiler.compile_regex(r"id-[0-9]+"))
    forced = xgrammar_forced_tokens(matcher, _encode(tok), 8, vocab_size=len(tok))
    assert tok.decode(forced.tokens) == "id-"
    choice = xgr.GrammarMatcher(compiler.compile_grammar('root ::= "Europe/Berlin" | "Europe/Paris"'))
    forced = xgrammar_forced_tokens(choice, _encode(tok), 8, vocab_size=len(tok))
    assert tok.decode(forced.tokens) in ("Europe/", "Europe")  # the shared prefix, cut to what the grammar accepts


def test_max_tokens_caps_and_the_drop_rule_leaves_the_last_token(llama3):
    tok, info, compiler = llama3
    grammar = compiler.compile_json_schema(json.dumps(PERSON), any_whitespace=False, separators=(",", ":"))
    matcher = xgr.GrammarMatcher(grammar)
    full = xgrammar_forced_tokens(matcher, _encode(tok), 16, vocab_size=len(tok))
    assert len(full) == 3
    assert xgrammar_forced_tokens(matcher, _encode(tok), 2, vocab_size=len(tok)).tokens == full.tokens[:2]
    assert xgrammar_forced_tokens(matcher, _encode(tok), 0, vocab_size=len(tok)).tokens == []
    assert xgrammar_forced_tokens(matcher, _encode(tok), 16, vocab_size=len(tok), last_token="drop").tokens == full.tokens[:-1]
    with pytest.raises(ValueError, match="last_token"):
        xgrammar_forced_tokens(matcher, _encode(tok), 16, last_token="merge")


def test_a_tokenization_the_grammar_refuses_is_cut_where_refused(llama3):
    tok, info, compiler = llama3
    matcher = xgr.GrammarMatcher(compiler.compile_regex("abc"))
    wrong = tok.encode("abx", add_special_tokens=False)
    forced = xgrammar_forced_tokens(matcher, lambda s: wrong, 8, vocab_size=len(tok))
    assert tok.decode(forced.tokens) in ("", "ab", "a")
    assert matcher.find_jump_forward_string() == "abc"


def test_only_allowed_token_reads_one_bit():
    row = np.zeros(4, dtype=np.int32)
    assert only_allowed_token(row, 128) is None
    row[2] = 1 << 5
    assert only_allowed_token(row, 128) == 69
    assert only_allowed_token(row, 69) is None  # outside the vocabulary
    row[3] = np.int32(-(2**31))  # bit 31: the sign bit
    assert only_allowed_token(row, 128) is None
    row[2] = 0
    assert only_allowed_token(row, 128) == 127


def test_forced_tokens_type():
    forced = ForcedTokens([1, 2, 3], 1)
    assert forced.mask_forced == [1] and forced.string_forced == [2, 3]
    assert forced.cut(0) == ForcedTokens() and forced.cut(2) == ForcedTokens([1, 2], 1)
    assert ForcedTokens.all_mask_forced([4, 5]).num_mask_forced == 2
    with pytest.raises(ValueError, match="num_mask_forced"):
        ForcedTokens([1], 2)


def test_llguidance_fast_forward_tokens(llama3):
    llguidance = pytest.importorskip("llguidance")
    hf = pytest.importorskip("llguidance.hf")

    tok, _, _ = llama3
    lltok = hf.from_tokenizer(tok)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(PERSON), defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(lltok, grammar)
    forced = llguidance_forced_tokens(matcher, 16)
    assert forced.num_mask_forced == 0 and forced.tokens
    assert tok.decode(forced.tokens).startswith('{"')
    assert llguidance_forced_tokens(matcher, 1).tokens == forced.tokens[:1]
    assert matcher.consume_tokens(forced.tokens)


def test_manager_and_grammar_constraint_expose_forced(llama3):
    from logitgate.structured.constraint_state import GrammarConstraint
    from logitgate.structured.manager import StructuredOutputManager
    from logitgate.structured.params import StructuredOutputsParams

    tok, info, _ = llama3
    with StructuredOutputManager(info, vocab_size=len(tok), encode=_encode(tok)) as manager:
        manager.add_request("r", StructuredOutputsParams(regex="id-[0-9]+;"))
        constraint = GrammarConstraint(manager, "r")
        forced = constraint.forced(8)
        assert tok.decode(forced.tokens) == "id-" and forced.num_mask_forced == 0
        assert constraint.forced_tokens(8) == forced.tokens
        constraint.commit(tok.encode("id-42;", add_special_tokens=False))
        assert constraint.forced(8) == ForcedTokens([tok.eos_token_id], 1)
    with StructuredOutputManager(info, vocab_size=len(tok)) as manager:  # no encoder: mask-forced only
        manager.add_request("r", StructuredOutputsParams(regex="id-[0-9]+;"))
        assert manager.forced("r", 8) == ForcedTokens()


def test_tree_cursor_forced_is_all_mask_forced():
    from logitgate.structured.constraint_state import TreeConstraint
    from logitgate.structured.tree import TreeDFA

    tree = TreeDFA.from_sequences([[5, 6, 7], [5, 6, 8]], vocab_size=16, end_token_id=1)
    forced = TreeConstraint(tree).forced(8)
    assert forced.tokens == [5, 6] and forced.num_mask_forced == 2
