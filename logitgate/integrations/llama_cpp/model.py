"""What the integration needs to know about a loaded `llama_cpp.Llama`: its vocabulary (size, stop
tokens, the bytes of every token), its identity for TokenTreePayload model-id checks, and the
xgrammar backend compiled over its vocabulary (one per model, kept in an LRU cache)."""
from __future__ import annotations

import ctypes
import os
from functools import cached_property
from typing import Any

from ...structured.compile_cache import LRUCache

# Tokenized before a text whose tokenization puts a space before it (SentencePiece), then dropped.
_SEPARATORS = ("\n", "a", ".")
_backends: LRUCache[Any] = LRUCache(8)  # xgrammar backends (each with its compiler cache), per model


class LlamaModelInfo:
    """Vocabulary and identity of one `llama_cpp.Llama` (read once, on first use)."""

    def __init__(self, llm: Any) -> None:
        if not all(hasattr(llm, name) for name in ("n_vocab", "tokenize", "token_eos", "model")):
            raise ValueError(f"expected a llama_cpp.Llama, got {type(llm).__name__}")
        self.llm = llm
        self.vocab_size = int(llm.n_vocab())
        self.eos_token_id = int(llm.token_eos())

    @cached_property
    def _vocab(self) -> Any:
        import llama_cpp

        return llama_cpp.llama_model_get_vocab(self.llm.model)

    @cached_property
    def stop_token_ids(self) -> list[int]:
        """End-of-generation tokens (EOS, end-of-turn, ...), as llama.cpp marks them."""
        import llama_cpp

        vocab = self._vocab
        stops = [t for t in range(self.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, t)]
        return stops or [self.eos_token_id]

    @cached_property
    def model_ids(self) -> frozenset[str]:
        """Names a TokenTreePayload's modelId may use for this model: the GGUF `general.name`, the
        file name and the file name without `.gguf`."""
        names = set()
        name = (getattr(self.llm, "metadata", None) or {}).get("general.name")
        if name:
            names.add(name)
        path = getattr(self.llm, "model_path", None)
        if path:
            base = os.path.basename(path)
            names.update({base, base[:-5] if base.endswith(".gguf") else base})
        return frozenset(names)

    @property
    def key(self) -> tuple:
        """Identifies the model's vocabulary for caches (the file and its size and mtime)."""
        path = getattr(self.llm, "model_path", None) or ""
        try:
            stat = os.stat(path)
            return (os.path.abspath(path), stat.st_size, stat.st_mtime_ns, self.vocab_size)
        except OSError:
            return (path, id(self.llm), self.vocab_size)

    def token_bytes(self, token: int) -> bytes:
        """The bytes the token stands for (b"" for control tokens such as BOS/EOS)."""
        import llama_cpp

        size = 64
        while True:
            buffer = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, size, 0, False)
            if n >= 0:
                return buffer.raw[:n]
            size = -n

    def tokenize(self, text: str) -> list[int]:
        """Token ids whose bytes are exactly `text` (no BOS; special-token text is not parsed), as the
        model writes it after other text. SentencePiece vocabularies (Llama-2, Mistral) put a space
        before a text they tokenize (`add_space_prefix`); that space is not part of `text`, so the
        text is tokenized after a separator that is then dropped: `strings=["Paris"]` completes
        "Paris" on every vocabulary, and `" Paris"` (the word after a space) where a space is meant."""
        encoded = text.encode("utf-8")
        ids = self._tokenize(text)
        if self.text_of(ids) == encoded:
            return ids
        for separator in _SEPARATORS:
            head = self._tokenize(separator)
            ids = self._tokenize(separator + text)
            if ids[: len(head)] == head and self.text_of(ids[len(head) :]) == encoded:
                return ids[len(head) :]
        raise ValueError(
            f"{text!r}: the tokenizer writes it as {self.text_of(self._tokenize(text))!r} and no separator "
            f"({', '.join(map(repr, _SEPARATORS))}) gives its exact bytes; give its token ids (sequences=)"
        )

    def _tokenize(self, text: str) -> list[int]:
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    def text_of(self, ids: list[int]) -> bytes:
        """The bytes `ids` add to a text (their pieces, as llama-cpp-python's completions join them)."""
        return b"".join(self.token_bytes(t) for t in ids)

    def grammar_backend(self) -> Any:
        """logitgate's xgrammar backend over this model's vocabulary (shared by every constraint
        on the same model file, so compiled grammars are cached across requests)."""

        def build() -> Any:
            import xgrammar as xgr

            from ...structured.xgrammar_backend import XGrammarBackend

            encoded = [self.token_bytes(t) for t in range(self.vocab_size)]
            info = xgr.TokenizerInfo(
                encoded, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            return XGrammarBackend(info, vocab_size=self.vocab_size)

        return _backends.get_or_create(self.key, build)
