"""`constrain(llm, ...)`: a compiled constraint for one llama-cpp-python model, checked against the
model's vocabulary and identity, from which each generation gets its own logits processor."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ...checks import is_integer
from ...structured.tree import TreeDFA
from ...structured.tree.loaders import parse_token_trie
from . import private_reads
from .model import LlamaModelInfo
from .processor import MODES, LlamaLogitsProcessor
from .state import GrammarTracker, TreeTracker

_TREE_SOURCES = ("tree", "strings", "sequences", "prefix_dict", "token_trie")
_GRAMMAR_SOURCES = {"json": "json", "regex": "regex", "grammar": "grammar", "choice": "choice"}


class LlamaConstraint:
    """A tree or grammar compiled for one model. Immutable and reusable: `logits_processor()` makes
    a fresh per-generation processor, `processors()` the list llama-cpp-python takes."""

    def __init__(self, info: LlamaModelInfo, *, tree: TreeDFA | None = None, grammar: Any = None,
                 mode: str = "greedy", marker: str | Sequence[int] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.info = info
        self.tree = tree
        self.grammar = grammar
        self.mode = mode
        self.marker = _check_marker(marker, info.vocab_size)
        if tree is not None:
            self.end_ids = frozenset({tree.end_token_id})
            self.tree_start = tree.start_token_id
        else:
            self.end_ids = frozenset(info.stop_token_ids)
            self.tree_start = None

    def new_tracker(self) -> TreeTracker | GrammarTracker:
        if self.tree is not None:
            return TreeTracker(self.tree)
        return GrammarTracker(self.grammar.fresh(), self.info.grammar_backend(), self.info.stop_token_ids)

    def logits_processor(self) -> LlamaLogitsProcessor:
        from .drafts import check_draft_model

        check_draft_model(self.info.llm)
        return LlamaLogitsProcessor(self)

    def processors(self) -> Any:
        """`llama_cpp.LogitsProcessorList([self.logits_processor()])`: pass as `logits_processor=`,
        a new one for every call."""
        from llama_cpp import LogitsProcessorList

        return LogitsProcessorList([self.logits_processor()])

    def __repr__(self) -> str:
        what = repr(self.tree) if self.tree is not None else "grammar"
        return f"<LlamaConstraint {what}, mode={self.mode}, marker={self.marker!r}>"


def _check_marker(marker: Any, vocab_size: int) -> bytes | tuple[int, ...] | None:
    if marker is None:
        return None
    if isinstance(marker, str):
        if not marker:
            raise ValueError("marker must not be empty")
        return marker.encode("utf-8")
    if isinstance(marker, (list, tuple)) and marker and all(is_integer(t) for t in marker):
        for t in marker:
            if not 0 <= t < vocab_size:
                raise ValueError(f"marker token id {t} is outside the model's vocabulary [0, {vocab_size})")
        return tuple(marker)
    raise ValueError(f"marker must be a non-empty string or list of token ids, got {marker!r}")


def _check_model_id(info: LlamaModelInfo, payload: Any, path: str | None, model_id: str | None) -> str:
    """The model id to check a TokenTreePayload against: `model_id=` when given, else the payload's
    own when it names this model (GGUF general.name or file name)."""
    if model_id is not None:
        return model_id
    payload_model = parse_token_trie(payload, path=path).model_id
    if payload_model not in info.model_ids:
        known = ", ".join(sorted(repr(m) for m in info.model_ids)) or "none"
        raise ValueError(
            f"token trie payload is for model {payload_model!r}, but the loaded model is {known}; "
            "token ids of another model's vocabulary would be wrong (pass model_id= to accept it explicitly)"
        )
    return payload_model


def constrain(
    llm: Any,
    *,
    tree: TreeDFA | None = None,
    strings: Iterable[str] | None = None,
    sequences: Iterable[Sequence[int]] | None = None,
    prefix_dict: Any = None,
    token_trie: Any = None,
    path: str | None = None,
    model_id: str | None = None,
    json: Any = None,
    regex: str | None = None,
    grammar: str | None = None,
    choice: Sequence[str] | None = None,
    disable_any_whitespace: bool = False,
    mode: str = "greedy",
    marker: str | Sequence[int] | None = None,
) -> LlamaConstraint:
    """Compile a constraint for `llm` (a `llama_cpp.Llama`). Exactly one of:

    - trees: `tree=` (a TreeDFA), `strings=` (tokenized with the model), `sequences=` (token ids),
      `prefix_dict=` (RTP-LLM config), `token_trie=` (TokenTreePayload; `path=` picks the
      descriptor; its modelId must name the loaded model, or pass `model_id=`);
    - grammars (xgrammar over the model's vocabulary): `json=` (a JSON schema), `regex=`,
      `grammar=` (EBNF), `choice=` (strings).

    Trees end with the model's EOS token. Token ids outside the vocabulary, a payload for another
    model and an invalid grammar raise ValueError naming the problem; compiled trees and grammars
    are cached (the same constraint compiles once per process)."""
    info = LlamaModelInfo(llm)
    private_reads.check(llm)
    given = {name: value for name, value in locals().items() if name in _TREE_SOURCES + tuple(_GRAMMAR_SOURCES) and value is not None}
    if len(given) != 1:
        names = ", ".join(_TREE_SOURCES + tuple(_GRAMMAR_SOURCES))
        raise ValueError(f"give exactly one constraint ({names}); got {sorted(given) or 'none'}")
    (source, value), = given.items()
    if source in _GRAMMAR_SOURCES:
        backend = info.grammar_backend()
        compiled = backend.compile(_GRAMMAR_SOURCES[source], value, disable_any_whitespace=disable_any_whitespace)
        return LlamaConstraint(info, grammar=compiled, mode=mode, marker=marker)
    vocab, end = info.vocab_size, info.eos_token_id
    if source == "tree":
        if not isinstance(value, TreeDFA):
            raise ValueError(f"tree must be a TreeDFA, got {type(value).__name__}")
        if value.max_token_id >= vocab:
            raise ValueError(f"the tree uses token id {value.max_token_id}, outside the model's vocabulary [0, {vocab})")
        if value.device.type != "cpu":
            raise ValueError(f"the tree is on {value.device}; llama-cpp-python's logits are on the host: build it with device='cpu'")
        built = value
    elif source == "strings":
        built = TreeDFA.from_strings(value, info.tokenize, end_token_id=end, vocab_size=vocab, device="cpu")
    elif source == "sequences":
        built = TreeDFA.from_sequences(value, end_token_id=end, vocab_size=vocab, device="cpu")
    elif source == "prefix_dict":
        built = TreeDFA.from_prefix_dict(value, vocab_size=vocab, device="cpu")
    else:
        checked = _check_model_id(info, value, path, model_id)
        built = TreeDFA.from_token_trie(
            value, end_token_id=end, path=path, model_id=checked, vocab_size=vocab, device="cpu"
        )
    return LlamaConstraint(info, tree=built, mode=mode, marker=marker)
