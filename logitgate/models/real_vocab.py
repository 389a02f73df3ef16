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

logger = logging.getLogger(__name__)

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
    return Path(os.environ.get("LOGITGATE_CACHE", Path.home() / ".cache" / "logitgate"))


def _check_name(name: str) -> str:
    if name not in VOCABS:
        raise ValueError(f"unknown vocabulary {name!r}; expected one of {', '.join(sorted(VOCABS))}")
    return VOCABS[name]


def _sdist_path() -> Path:
    folder = cache_dir() / "sdist"
    found = sorted(folder.glob(f"llama_cpp_python-{SDIST_VERSION}.tar.gz"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    logger.info("downloading %s==%s (source distribution, ~75 MB) for its GGUF vocabularies", SDIST_PACKAGE, SDIST_VERSION)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", f"{SDIST_PACKAGE}=={SDIST_VERSION}", "-d", str(folder)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(folder.glob(f"llama_cpp_python-{SDIST_VERSION}.tar.gz"))
    if not found:
        raise RuntimeError(
            f"could not download {SDIST_PACKAGE}=={SDIST_VERSION} from the package registry "
            f"(pip exit {done.returncode}): {done.stderr.strip()[-500:]}"
        )
    return found[0]


def gguf_vocab_file(name: str) -> Path:
    """The GGUF vocabulary file of `name` (see VOCABS), extracted into the cache on first use."""
    filename = _check_name(name)
    target = cache_dir() / "gguf" / filename
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    member = f"llama_cpp_python-{SDIST_VERSION}/{_MEMBER_DIR}/{filename}"
    with tarfile.open(_sdist_path()) as archive:
        source = archive.extractfile(member)
        if source is None:
            raise RuntimeError(f"{member} is not a file in the {SDIST_PACKAGE} source distribution")
        partial = target.with_suffix(".part")
        partial.write_bytes(source.read())
        partial.replace(target)  # atomic: a concurrent reader never sees half a file
    return target


def load_tokenizer(name: str) -> Any:
    """A Hugging Face tokenizer (PreTrainedTokenizerFast) for a real vocabulary, offline.

    The first call converts the GGUF file (needs `gguf`) and saves the result under the cache; later
    calls load the saved tokenizer."""
    _check_name(name)
    from transformers import AutoTokenizer

    saved = cache_dir() / "tokenizers" / name
    if (saved / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(saved))
    gguf = gguf_vocab_file(name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    partial = saved.with_name(f"{name}.part{os.getpid()}")
    tokenizer.save_pretrained(str(partial))
    if saved.exists():  # another process saved it first: keep theirs, drop this copy
        shutil.rmtree(partial, ignore_errors=True)
    else:
        partial.rename(saved)
    return tokenizer
