"""Real tokenizers, offline: llama.cpp's GGUF vocabulary files, loaded as Hugging Face tokenizers.

llama.cpp ships the vocabularies of common model families (Llama-3's 128256-token BPE, Qwen2, the
Llama-2 SentencePiece model, GPT-2, Phi-3, ...) as small GGUF files inside llama-cpp-python's source
distribution. Nothing here downloads from a model hub: the source distribution comes from the
package registry with `pip download` (the one network step, done once), the GGUF file is extracted
from it, converted by transformers (needs the `gguf` package, ~20 s) and the converted tokenizer is
saved, so later loads take well under a second.

Cache: `$LOGITGATE_CACHE` or `~/.cache/logitgate`. Tests and benchmarks use this for realistic
vocabularies; a machine that cannot reach the registry gets a clear RuntimeError.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

from .. import envs

logger = logging.getLogger(__name__)


class VocabularyUnavailable(RuntimeError):
    """The vocabularies cannot be had here: their source distribution is not cached and the package
    registry cannot be reached (a machine without network). Tests and executed docs skip on it,
    naming why; everything else gets it as the RuntimeError it is."""

SDIST_PACKAGE = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
_MEMBER_DIR = "vendor/llama.cpp/models"

# Short name -> the GGUF vocabulary file in llama.cpp's models/ folder.
VOCABS = {
    "llama3": "ggml-vocab-llama-bpe.gguf",  # Llama-3 BPE, 128256 tokens
    "qwen2": "ggml-vocab-qwen2.gguf",
    "llama2": "ggml-vocab-llama-spm.gguf",  # Llama-2 SentencePiece, 32000 tokens, adds BOS by default
    "gpt2": "ggml-vocab-gpt-2.gguf",
    "phi3": "ggml-vocab-phi-3.gguf",
    "deepseek-coder": "ggml-vocab-deepseek-coder.gguf",
}


def cache_dir() -> Path:
    value = envs.read("LOGITGATE_CACHE")
    return Path(value if value is not None else Path.home() / ".cache" / "logitgate")


def _check_name(name: str) -> str:
    if name not in VOCABS:
        raise ValueError(f"unknown vocabulary {name!r}; expected one of {', '.join(sorted(VOCABS))}")
    return VOCABS[name]


def _download_command(folder: Path) -> list[str]:
    # Build isolation stays on: pip reads an sdist's metadata through its build backend
    # (scikit-build-core here), which it then fetches into a throw-away environment itself; with
    # isolation off it must already be importable, which a fresh environment never has.
    return [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
            f"{SDIST_PACKAGE}=={SDIST_VERSION}", "-d", str(folder)]


def _sdist_path() -> Path:
    folder = cache_dir() / "sdist"
    pattern = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    found = sorted(folder.glob(pattern))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    logger.info("downloading %s==%s (source distribution, ~75 MB) for its GGUF vocabularies", SDIST_PACKAGE, SDIST_VERSION)
    cmd = _download_command(folder)
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(folder.glob(pattern))
    if not found:
        raise VocabularyUnavailable(
            f"could not download {SDIST_PACKAGE}=={SDIST_VERSION} from the package registry into "
            f"{folder} (pip exit {done.returncode}): {done.stderr.strip()[-500:]}\n"
            f"retry with: {' '.join(cmd)}"
        )
    return found[0]


def source_distribution() -> Path:
    """The cached llama-cpp-python source distribution (downloaded on first use); `make test` also
    builds llama-cpp-python from it (tests/integrations/llama_cpp)."""
    return _sdist_path()


def _discard(path: Path, why: BaseException) -> None:
    """Drop a cached file or folder that cannot be read, so the next step rebuilds it."""
    logger.warning("cached %s is unreadable (%s: %s); rebuilding it", path, type(why).__name__, why)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _extract(name: str, target: Path) -> None:
    member = f"llama_cpp_python-{SDIST_VERSION}/{_MEMBER_DIR}/{VOCABS[name]}"
    sdist = _sdist_path()
    try:
        with tarfile.open(sdist) as archive:
            source = archive.extractfile(member)
            if source is None:
                raise RuntimeError(f"{member} is not a file in {sdist}")
            data = source.read()
    except (tarfile.TarError, EOFError, OSError) as exc:  # truncated or corrupted download
        _discard(sdist, exc)
        raise RuntimeError(f"{sdist} is corrupted ({exc}); it was removed, the next call downloads it again") from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.part{os.getpid()}")
    partial.write_bytes(data)
    partial.replace(target)  # atomic: a concurrent reader never sees half a file


def gguf_vocab_file(name: str) -> Path:
    """The GGUF vocabulary file of `name` (see VOCABS), extracted into the cache on first use."""
    _check_name(name)
    target = cache_dir() / "gguf" / VOCABS[name]
    if not target.exists():
        _extract(name, target)
    return target


def _convert(name: str, saved: Path) -> Any:
    from transformers import AutoTokenizer

    gguf = gguf_vocab_file(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:  # a truncated GGUF file: struct.error, ValueError, ... from the reader
        _discard(gguf, exc)
        gguf = gguf_vocab_file(name)  # extracted again from the source distribution
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except Exception as again:
            raise RuntimeError(f"cannot read the GGUF vocabulary {gguf}: {again}") from again
    partial = saved.with_name(f"{name}.part{os.getpid()}")
    tokenizer.save_pretrained(str(partial))
    if saved.exists():  # another process saved it first: keep theirs, drop this copy
        shutil.rmtree(partial, ignore_errors=True)
    else:
        partial.rename(saved)
    return tokenizer


def load_tokenizer(name: str) -> Any:
    """A Hugging Face tokenizer (PreTrainedTokenizerFast) for a real vocabulary, offline.

    The first call converts the GGUF file (needs `gguf`) and saves the result under the cache; later
    calls load the saved tokenizer. A cached file that cannot be read (a truncated write, a full
    disk) is removed and rebuilt once, with a warning naming it."""
    _check_name(name)
    from transformers import AutoTokenizer

    saved = cache_dir() / "tokenizers" / name
    if (saved / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(saved))
        except Exception as exc:  # JSONDecodeError and friends from a damaged save
            _discard(saved, exc)
    return _convert(name, saved)
