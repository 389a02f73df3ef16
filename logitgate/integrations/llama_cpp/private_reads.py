"""What the llama.cpp integration uses of llama-cpp-python beyond its documented Python API, one row
each: the name, why, and until when (what would retire the row).

`constrain()` resolves every row against the installed llama-cpp-python and the given `Llama`
(`check(llm)`), so a version that renames or drops one fails there, naming the row, instead of in
the middle of a generation (where llama-cpp-python's C callback would swallow the error). Tested
with llama-cpp-python TESTED_VERSION (tests/integrations/llama_cpp/test_private_reads.py), which
also checks that every private name the integration's source uses is a row.

Public names are used where llama-cpp-python has them (`Llama.model` for the model pointer,
`Llama.input_ids[:n_tokens]` for the evaluated tokens). Test helpers and logitgate/bench/llama_cpp.py
also read `Llama._ctx` (`get_logits`, `decode`, to compute references and count forward passes);
they are not the library and fail on their own, loudly.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

__all__ = ["PRIVATE_READS", "TESTED_VERSION", "PrivateRead", "check", "resolve"]

TESTED_VERSION = "0.3.36"  # the llama-cpp-python the rows are pinned against (Makefile, pyproject.toml)

LLM = "Llama"  # rows resolved on the Llama instance given to constrain()
_BUMP = "review on every llama-cpp-python bump"
_C_API = ("a binding of llama.cpp's C API, which renames functions between releases "
          "(llama_token_is_eog became llama_vocab_is_eog)")


@dataclass(frozen=True)
class PrivateRead:
    owner: str  # LLM, or the module that defines `path`
    path: str  # dotted attribute path from the owner
    use: str  # "call", "read" or "write"
    why: str
    until: str
    params: tuple[str, ...] = ()  # keyword parameters logitgate passes (checked on calls)

    @property
    def name(self) -> str:
        return f"{self.owner}.{self.path}"


PRIVATE_READS: tuple[PrivateRead, ...] = (
    PrivateRead(LLM, "_init_sampler", "call",
                "skip-ahead (generate) builds llama-cpp-python's sampler chain once per generation, with the "
                "constraint's processor first (the public Llama.sample builds and reseeds a new chain every token)",
                f"a public sampler-chain constructor in llama-cpp-python; {_BUMP}",
                params=("top_k", "top_p", "min_p", "temp", "repeat_penalty", "logits_processor")),
    PrivateRead("llama_cpp._internals", "LlamaSampler.sample", "call",
                "samples one token from that chain (what _init_sampler returns)", f"as _init_sampler; {_BUMP}"),
    PrivateRead(LLM, "_ctx", "read",
                "the LlamaContext LlamaSampler.sample takes (the public Llama.ctx is the bare pointer)",
                f"as _init_sampler; {_BUMP}"),
    PrivateRead(LLM, "_logits_all", "write",
                "skip-ahead drafts a grammar's forced strings only when llama.cpp keeps the logits of every "
                "position of a batch (Llama(logits_all=True)): each draft's position is sampled from its row; "
                "cleared for batches without drafts (the prompt among them), which need their last row only, "
                "and set again when the generation ends",
                f"a public flag or per-token logits request in llama-cpp-python; {_BUMP}"),
    PrivateRead(LLM, "n_tokens", "write",
                "skip-ahead keeps the KV cache of the prompt prefix shared with the last evaluation, and cuts it "
                "back past a refused draft: eval() drops the cache past n_tokens (llama-cpp-python's own "
                "generate does the same)",
                f"a public way to truncate the evaluated tokens; {_BUMP}"),
    PrivateRead("llama_cpp", "llama_model_get_vocab", "call",
                "the vocabulary handle for the stop-token and token-bytes calls below", _C_API),
    PrivateRead("llama_cpp", "llama_vocab_is_eog", "call",
                "the model's end-of-generation tokens (the processor's fallback and the tree's ends)", _C_API),
    PrivateRead("llama_cpp", "llama_token_to_piece", "call",
                "each token's bytes (xgrammar's vocabulary, text markers, the exact text of strings=)", _C_API),
)


def resolve(row: PrivateRead, llm: Any) -> Any:
    """The object `row` names, on `llm` or in its module; AttributeError naming what is missing."""
    if row.owner == LLM:
        obj = llm
    else:
        import importlib

        obj = importlib.import_module(row.owner)
    for part in row.path.split("."):
        obj = getattr(obj, part)
    if row.use == "write" and not (row.path in vars(llm) and isinstance(obj, int)):
        raise AttributeError(f"{row.path} is not a plain integer attribute of the Llama instance")
    if row.params:
        missing = [p for p in row.params if p not in inspect.signature(obj).parameters]
        if missing:
            raise AttributeError(f"no keyword parameter(s) {', '.join(missing)}")
    return obj


def check(llm: Any) -> None:
    """Resolve every row; RuntimeError naming the first that does not resolve (nothing is changed)."""
    for row in PRIVATE_READS:
        try:
            resolve(row, llm)
        except (AttributeError, ImportError, ValueError, TypeError) as exc:
            import llama_cpp

            version = getattr(llama_cpp, "__version__", "?")
            raise RuntimeError(
                f"llama-cpp-python {version} does not have {row.name} as logitgate uses it ({row.use}: {exc}); "
                f"logitgate needs it because {row.why}. The llama.cpp integration is tested with "
                f"llama-cpp-python=={TESTED_VERSION} (row {row.name} of "
                f"logitgate/integrations/llama_cpp/private_reads.py, until {row.until})"
            ) from exc
