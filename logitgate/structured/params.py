"""StructuredOutputsParams: which constraint a request decodes under (vLLM's field names)."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..checks import is_integer

__all__ = ["CONSTRAINT_KINDS", "StructuredOutputsParams"]

_P = TypeVar("_P")

# The constraint fields, in the order they are reported. Exactly one is set per request.
CONSTRAINT_KINDS: tuple[str, ...] = (
    "json",
    "json_object",
    "regex",
    "grammar",
    "choice",
    "structural_tag",
    "prefix_dict",
    "token_trie",
)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the constraint fields, plus options.

    - ``json``: a JSON schema (dict or JSON string).
    - ``json_object``: True for "any JSON object".
    - ``regex``: a regular expression the whole output must match.
    - ``grammar``: an EBNF (GBNF) grammar with a ``root`` rule.
    - ``choice``: the output is exactly one of these strings.
    - ``structural_tag``: an xgrammar structural tag (dict or JSON string).
    - ``prefix_dict``: an RTP-LLM prefix-dict config (path, JSON string or dict) for TreeDFA.
    - ``token_trie``: a TokenTreePayload (path, JSON string or dict) for TreeDFA; its end token is
      ``end_token_id``, else the payload's top-level ``end_token_id``, else the tokenizer's first
      stop token.
    - ``disable_any_whitespace``: JSON without free whitespace (``json`` / ``json_object``).
    - ``enable_in_reasoning``: constrain the reasoning span too; None = the manager's default.
    """

    json: str | Mapping[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: Sequence[str] | None = None
    structural_tag: str | Mapping[str, Any] | None = None
    prefix_dict: str | Mapping[str, Any] | None = None
    token_trie: str | Mapping[str, Any] | None = None
    disable_any_whitespace: bool = False
    enable_in_reasoning: bool | None = None
    end_token_id: int | None = None  # token_trie only

    def __post_init__(self) -> None:
        set_kinds = [k for k in CONSTRAINT_KINDS if _is_set(k, getattr(self, k))]
        if len(set_kinds) != 1:
            named = ", ".join(set_kinds) if set_kinds else "none"
            raise ValueError(
                f"StructuredOutputsParams needs exactly one of {', '.join(CONSTRAINT_KINDS)}; got {named}"
            )
        kind = set_kinds[0]
        value = getattr(self, kind)
        if kind == "json_object" and value is not True:
            raise ValueError(f"json_object must be True or None, got {value!r}")
        if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
            raise ValueError(f"{kind} must be a non-empty string, got {value!r}")
        if kind == "json" and not isinstance(value, (str, Mapping)):
            raise ValueError(f"json must be a JSON schema as a dict or a JSON string, got {type(value).__name__}")
        if kind == "structural_tag" and not isinstance(value, (str, Mapping)):
            raise ValueError(f"structural_tag must be a dict or a JSON string, got {type(value).__name__}")
        # A path is read when the constraint compiles (params may be built where the file is not):
        # a missing or malformed file fails that request with an error naming the file.
        if kind in ("prefix_dict", "token_trie") and not isinstance(value, (str, Mapping, os.PathLike)):
            raise ValueError(f"{kind} must be a dict, a JSON string or a path, got {type(value).__name__}")
        if kind == "choice":
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
                raise ValueError(f"choice must be a non-empty list of strings, got {value!r}")
            for i, item in enumerate(value):
                if not isinstance(item, str):
                    raise ValueError(f"choice[{i}] must be a string, got {type(item).__name__}")
            # Frozen means hashable: store the choices as a tuple.
            object.__setattr__(self, "choice", tuple(value))
        if self.end_token_id is not None:
            if kind != "token_trie":
                raise ValueError(f"end_token_id applies to token_trie only, not to {kind}")
            if not is_integer(self.end_token_id) or self.end_token_id < 0:
                raise ValueError(f"end_token_id must be a non-negative int, got {self.end_token_id!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        """The name of the constraint field that is set."""
        return next(k for k in CONSTRAINT_KINDS if _is_set(k, getattr(self, k)))

    @property
    def value(self) -> Any:
        """The value of the constraint field that is set, as given."""
        return getattr(self, self.kind)

    @property
    def spec(self) -> Any:
        """What the grammar engine compiles: the value, with a token_trie's `end_token_id` folded
        into the payload (where the tree backend reads it)."""
        value = self.value
        if self.kind == "token_trie" and self.end_token_id is not None:
            return {**load_token_trie_payload(value), "end_token_id": self.end_token_id}
        return value

    def cache_key(self) -> tuple[str, str, bool]:
        """A hashable key equal for equal constraints (dicts compared by content, keys sorted)."""
        spec = self.spec
        if isinstance(spec, Mapping):
            text = json.dumps(spec, sort_keys=True, separators=(",", ":"))
        elif isinstance(spec, os.PathLike):
            text = os.fspath(spec)
        elif isinstance(spec, tuple):
            text = json.dumps(list(spec))
        else:
            text = str(spec)
        return (self.kind, text, self.disable_any_whitespace)

    def __hash__(self) -> int:
        return hash((self.cache_key(), self.enable_in_reasoning))


def load_token_trie_payload(value: Any) -> dict[str, Any]:
    """A token_trie payload (dict, JSON string or path) as a dict; ValueError naming the file."""
    from .tree.loaders import load_json  # numpy only; kept out of this module's import

    payload, _ = load_json(dict(value) if isinstance(value, Mapping) else value, "token_trie payload")
    if not isinstance(payload, dict):
        raise ValueError(f"a token_trie payload must be a JSON object, got {type(payload).__name__}")
    return payload


def _is_set(kind: str, value: Any) -> bool:
    # json_object=False means "not requested", like vLLM's bool | None.
    return value is not None and not (kind == "json_object" and value is False)
