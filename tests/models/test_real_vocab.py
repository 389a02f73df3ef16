"""The offline real-vocabulary loader: llama.cpp's GGUF vocabularies as Hugging Face tokenizers."""
import pytest

from logitgate.models import real_vocab

pytest.importorskip("gguf")


def test_unknown_vocabulary_is_named():
    with pytest.raises(ValueError, match="unknown vocabulary 'llama9'"):
        real_vocab.load_tokenizer("llama9")


@pytest.mark.parametrize(
    ("name", "size", "word"),
    [("llama3", 128256, "hello"), ("qwen2", 151643, "hello"), ("llama2", 32000, "▁hello")],
)
def test_real_vocabularies_load_offline_with_their_sizes(name, size, word):
    tokenizer = real_vocab.load_tokenizer(name)
    assert len(tokenizer) >= size
    ids = tokenizer.encode("hello", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == [word]
