"""Per-request sampling parameters, validated on construction with errors naming the field.

Field names and defaults follow vLLM's `SamplingParams`, so engine code ports over unchanged;
`max_thinking_tokens` (ThinkMode) is logitgate's own.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# One StructuredOutputsParams for the whole library: the structured-outputs manager consumes it.
from ..checks import is_integer, short_repr
from ..structured.params import StructuredOutputsParams

__all__ = ["SAMPLING_EPS", "SamplingParams", "SamplingType", "StructuredOutputsParams"]

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing by them overflows.
SAMPLING_EPS = 1e-5
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


# Integer fields: numpy integers pass their checks (checks.is_integer) and are kept as plain ints.
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "max_thinking_tokens")


def _is_number(value: Any) -> bool:
    return is_integer(value) or isinstance(value, float)


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How one request samples its tokens (vLLM's fields and defaults).

    temperature: 0 (or below SAMPLING_EPS) is greedy; top_k: 0 or -1 keeps every token; top_p in
    (0, 1]; min_p in [0, 1]; seed: a per-request generator makes the request reproducible;
    min_tokens: stop tokens (stop_token_ids and, unless ignore_eos, the EOS) are masked until this
    many tokens were generated; logit_bias: token id -> value added to its logit; logprobs: the
    number of top log-probabilities to return per token (None: none); max_thinking_tokens: the
    thinking budget ThinkMode enforces (None: no budget); extra_args: for custom logits processors.
    Greedy requests ignore top_k, top_p and min_p (they are reset, as in vLLM).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    max_thinking_tokens: int | None = None
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not is_integer(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_integer(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int: -1 or 0 (all tokens) or >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not is_integer(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1)):
            # torch.Generator.manual_seed takes [-2**63, 2**64); request sample s uses seed + s.
            raise ValueError(f"seed must be an int in [{SEED_MIN}, {SEED_MAX - (self.n - 1)}] or None, got {short_repr(self.seed)}")
        if self.max_tokens is not None and (not is_integer(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        if not is_integer(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        self.stop_token_ids = _token_id_list(self.stop_token_ids, "stop_token_ids")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias_dict(self.logit_bias)
        if self.logprobs is not None and (not is_integer(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an int >= 0 or None, got {self.logprobs!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}"
            )
        if self.max_thinking_tokens is not None and (not is_integer(self.max_thinking_tokens) or self.max_thinking_tokens < 0):
            raise ValueError(f"max_thinking_tokens must be an int >= 0 or None, got {self.max_thinking_tokens!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}")
        for name in _INT_FIELDS:
            if getattr(self, name) is not None:
                setattr(self, name, int(getattr(self, name)))
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature < SAMPLING_EPS:
            if self.n > 1:
                raise ValueError(f"n must be 1 for greedy sampling (temperature {self.temperature}), got n={self.n}")
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    def all_stop_token_ids(self, eos_token_id: int | None) -> set[int]:
        """The tokens that end this request: stop_token_ids plus the EOS unless ignore_eos."""
        stops = set(self.stop_token_ids)
        if eos_token_id is not None and not self.ignore_eos:
            stops.add(eos_token_id)
        return stops

    def verify(self, vocab_size: int) -> None:
        """Check the token ids against the model's vocabulary; ValueError names the first bad one."""
        for token in self.stop_token_ids:
            if token >= vocab_size:
                raise ValueError(f"stop_token_ids has token id {token}, outside the vocabulary [0, {vocab_size})")
        for token in self.logit_bias or {}:
            if token >= vocab_size:
                raise ValueError(f"logit_bias has token id {token}, outside the vocabulary [0, {vocab_size})")
        if self.logprobs is not None and self.logprobs > vocab_size:
            raise ValueError(f"logprobs={self.logprobs} asks for more log-probabilities than the vocabulary has ({vocab_size})")


def _token_id_list(values: Iterable[int] | None, name: str) -> list[int]:
    if values is None:
        return []
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a list of token ids, got {type(values).__name__}")
    out = list(values)
    for token in out:
        if not is_integer(token) or token < 0:
            raise ValueError(f"{name} has {token!r}, not a token id (an int >= 0)")
    return [int(token) for token in out]


def _logit_bias_dict(bias: dict) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        # JSON (the OpenAI API) gives the ids as strings.
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not is_integer(token) or token < 0:
            raise ValueError(f"logit_bias has key {key!r}, not a token id (an int >= 0)")
        if not _is_number(value) or not math.isfinite(value):
            raise ValueError(f"logit_bias[{key!r}] must be a finite number, got {value!r}")
        out[int(token)] = float(value)
    return out
