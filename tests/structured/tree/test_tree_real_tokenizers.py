"""TreeDFA.from_strings with real Hugging Face tokenizers: no special tokens in the tree."""
import pytest

from logitgate import TreeDFA
from tests.helpers.real_tokenizers import real_tokenizer

NAMES = ["Europe/Berlin", "Europe/Bratislava", "Europe/Paris", "America/Argentina/Buenos_Aires", "UTC", "Asia/Ho_Chi_Minh"]
VOCABS = ["llama3", "qwen2", "llama2"]  # Llama-3 BPE, Qwen2 BPE, Llama-2 SentencePiece (adds BOS on a call)


@pytest.mark.parametrize("name", VOCABS)
def test_from_strings_with_a_real_tokenizer_holds_only_the_texts_tokens(name):
    tok = real_tokenizer(name)
    eos = tok.eos_token_id
    tree = TreeDFA.from_strings(NAMES, tok, end_token_id=eos, vocab_size=len(tok))
    encoded = {n: tok.encode(n, add_special_tokens=False) for n in NAMES}
    assert tree.allowed(tree.root) == sorted({ids[0] for ids in encoded.values()})
    assert tok.bos_token_id not in tree.allowed(tree.root)
    for text, ids in encoded.items():
        assert eos in tree.allowed(tree.walk(ids)), text  # every name is a complete path
        assert tok.decode(ids) == text
    # The `tokenizers` object underneath gives the same tree.
    raw = TreeDFA.from_strings(NAMES, tok.backend_tokenizer, end_token_id=eos, vocab_size=len(tok))
    assert raw.stats()["nodes"] == tree.stats()["nodes"]
    assert all(raw.allowed(raw.walk(ids)) == tree.allowed(tree.walk(ids)) for ids in encoded.values())


def test_llama2_called_directly_would_have_added_bos():
    tok = real_tokenizer("llama2")
    assert tok("UTC")["input_ids"][0] == tok.bos_token_id  # why from_strings must not call it
    tree = TreeDFA.from_strings(["UTC"], tok, end_token_id=tok.eos_token_id)
    assert tree.allowed(tree.root) == [tok.encode("UTC", add_special_tokens=False)[0]]


@pytest.mark.parametrize("name, text", [("llama3", "Europe<|eot_id|>"), ("llama2", "x</s>")])
def test_special_token_text_inside_a_string_is_refused(name, text):
    tok = real_tokenizer(name)
    special = text[text.index("<"):]
    with pytest.raises(ValueError, match=f"string {text!r} tokenizes to the special token '{special}'"):
        TreeDFA.from_strings(["UTC", text], tok, end_token_id=tok.eos_token_id)


class AlwaysAddsBos:
    """A Hugging Face-style tokenizer whose encode adds BOS whatever it is asked (as some
    tokenizer configs do): from_strings must refuse it rather than build a tree rooted at BOS."""

    all_special_ids = [1, 2]

    def convert_ids_to_tokens(self, i):
        return {1: "<s>", 2: "</s>"}[i]

    def encode(self, text, add_special_tokens=True):
        return [1] + [10 + ord(c) % 50 for c in text]


def test_a_tokenizer_that_still_adds_bos_is_refused():
    with pytest.raises(ValueError, match=r"string 'ab' tokenizes to the special token '<s>' \(id 1\) at position 0"):
        TreeDFA.from_strings(["ab"], AlwaysAddsBos(), end_token_id=2)
