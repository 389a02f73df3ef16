"""Hugging Face `generate()` logits processors (public name: `logitgate.integrations.transformers`).

- `TreeLogitsProcessor(tree)` constrains every row to paths of a TreeDFA. Row states are derived
  from `input_ids` at every call by replaying the generated tokens through the compiled tree on
  the device: no state is carried between calls, so beam search reordering and forking rows cannot
  corrupt it, and nothing syncs with the host.
- `GrammarLogitsProcessor(tokenizer_info, json=... | regex=... | grammar=... | choice=... | ...)`
  constrains every row with a grammar (xgrammar). Grammar matchers run on the host, so each call
  copies the generated tokens to the host once; a row's matcher is found by its generated prefix
  (the same tokens always mean the same state) and forked from its parent's, so beams and
  `num_return_sequences` are safe too.
- `tree_generation_kwargs(tree, model)`: the processor and `eos_token_id` (the model's EOS plus the
  tree's end token) for `model.generate(..., **kwargs)`, so generation stops at the tree's end
  token when it is not EOS (a logits processor cannot end a Hugging Face generation by itself).
- `speculative_generate(target, draft, ...)` is in speculative.py: speculative decoding for Hugging
  Face models through logitgate's decode loop.

Both processors work with greedy search, sampling, beam search and `num_return_sequences`. Rows
that finished (HF appends the pad token to them) and rows a constraint cannot continue allow the
end / stop tokens only, so no row is ever left without a token (sampling would fail on it).
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...backends.transfer import to_device
from ...checks import is_integer
from ...structured.bitmask import allocate_token_bitmask, apply_token_bitmask_inplace, bitmask_from_token_ids
from ...structured.grammar import Grammar, GrammarBackend
from ...structured.manager import DEFAULT_KIND_BACKENDS
from ...structured.params import StructuredOutputsParams
from ...structured.registry import get_grammar_backend_factory
from ...structured.tree import TreeDFA
from ...structured.tree.candidates import keep_only_allowed
from ...structured.tree.prompt import warn_prompt_start

try:  # transformers is optional: the processors are plain callables either way
    from transformers import LogitsProcessor as _HFLogitsProcessor
except ImportError:  # pragma: no cover - exercised only without the hf extra
    _HFLogitsProcessor = object

logger = logging.getLogger(__name__)

__all__ = ["GrammarLogitsProcessor", "TreeLogitsProcessor", "tree_generation_kwargs"]


class _PromptTracker:
    """Where the generated tokens start in `input_ids`.

    Hugging Face calls a processor with the prompt plus everything generated so far, exactly one
    column more per step; any other length starts a new generation, whose prompt is that input.
    The one case this cannot tell apart is a new prompt exactly one column longer than the last
    input seen: `reset()` between generations (or one processor per `generate` call) is always
    right. A fixed `prompt_length` (for callers whose lengths jump, such as HF's assisted
    generation) disables the detection."""

    def __init__(self, prompt_length: int | None) -> None:
        if prompt_length is not None and (not is_integer(prompt_length) or prompt_length < 0):
            raise ValueError(f"prompt_length must be an int >= 0 or None, got {prompt_length!r}")
        self.fixed = prompt_length
        self.reset()

    def reset(self) -> None:
        self.start, self.last = self.fixed, -1

    def observe(self, length: int) -> tuple[int, bool]:
        """(first generated column, whether this call starts a new generation)."""
        if self.fixed is None:
            new = self.start is None or length != self.last + 1
            if new:
                self.start = length
        else:
            new = length <= self.last
        self.last = length
        if length < self.start:
            raise ValueError(f"input_ids has {length} columns, fewer than the prompt length {self.start}")
        return self.start, new


def _check_scores(input_ids: torch.Tensor, scores: torch.Tensor) -> None:
    if input_ids.dim() != 2 or scores.dim() != 2 or input_ids.shape[0] != scores.shape[0]:
        raise ValueError(
            f"input_ids (B, L) and scores (B, V) must have the same rows, got {tuple(input_ids.shape)} and {tuple(scores.shape)}"
        )


def _same(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and a.shape == b.shape and a.device == b.device and torch.equal(a, b)


class TreeLogitsProcessor(_HFLogitsProcessor):
    """Only tokens on the tree are allowed; the end token is the fallback (RTP-LLM semantics).

    The prompt of every row must end where the tree starts (for a prefix dict: with
    `start_token_id`). `prompt_length` defaults to the input length at the first call of a
    generation (see `reset`). Build the tree on the model's device (`device=model.device`) to keep
    every step on the device; a tree elsewhere works, at the cost of a copy per step.
    """

    def __init__(self, tree: TreeDFA, prompt_length: int | None = None) -> None:
        if not isinstance(tree, TreeDFA):
            raise ValueError(f"tree must be a TreeDFA, got {type(tree).__name__}")
        self.tree = tree
        self._prompt = _PromptTracker(prompt_length)

    def reset(self) -> None:
        """Forget the current generation: the next call's input is a new prompt. Needed only when one
        processor is reused and a new prompt is exactly one token longer than the last input seen."""
        self._prompt.reset()

    def states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Tree state of every row after its generated tokens (batched, on the tree's device)."""
        start, new = self._prompt.observe(input_ids.shape[1])
        if new and self.tree.start_token_id is not None:
            self._check_prompts(input_ids[:, :start])
        tree_ids = input_ids[:, start:].to(self.tree.device)
        states = self.tree.initial_states(input_ids.shape[0])
        for column in range(tree_ids.shape[1]):
            states = self.tree.advance(states, tree_ids[:, column])
        return states

    def _check_prompts(self, prompts: torch.Tensor) -> None:
        """Warn once per generation (its first call) when prompts do not end in a prefix dict's start
        token: one small copy to the host per generation, never per step."""
        if prompts.shape[1] == 0:
            warn_prompt_start(self.tree, [], "generate()")
            return
        last = prompts[:, -1].tolist()
        bad = [row for row, token in enumerate(last) if token != self.tree.start_token_id]
        if bad:
            rows = ", ".join(map(str, bad[:8])) + (" ..." if len(bad) > 8 else "")
            warn_prompt_start(self.tree, [last[bad[0]]], f"generate() row(s) {rows}")

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        _check_scores(input_ids, scores)
        rows, vocab = scores.shape
        if self.tree.max_token_id >= vocab:
            raise ValueError(f"the tree uses token id {self.tree.max_token_id} but the scores have only {vocab} columns")
        states = self.states(input_ids)
        if scores.device == self.tree.device:
            # Fill each row with -inf and put its allowed logits back: no bitmask over the vocabulary
            # (structured/tree/candidates.py; columns past the tree's tokens end up -inf too).
            return keep_only_allowed(self.tree, scores.clone(), states)
        # Sized for the scores, so columns past the tree's tokens (LM-head padding) are masked too.
        bitmask = allocate_token_bitmask(rows, vocab, device=self.tree.device)
        self.tree.fill_bitmask(states, bitmask)
        scores = scores.clone()  # transformers expects a new tensor; callers may reuse the input
        apply_token_bitmask_inplace(scores, to_device(bitmask, scores.device))
        return scores


class _Row:
    """One distinct generated prefix: its grammar, and whether the grammar rejected a token of it
    (a beam-search candidate kept at -inf, or a token forced by another processor)."""

    __slots__ = ("grammar", "dead")

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.dead = False

    @property
    def ended(self) -> bool:
        return self.dead or self.grammar.is_terminated()

    def commit(self, token: int) -> None:
        if self.ended:
            return  # tokens after the stop token (HF's padding) change nothing
        if not self.grammar.accept_tokens((token,)):
            self.dead = True


class GrammarLogitsProcessor(_HFLogitsProcessor):
    """Only tokens the grammar accepts are allowed; after the grammar's stop token only stop tokens.

    Args:
        tokenizer_info: the `xgrammar.TokenizerInfo` of the model's tokenizer, built with the
            model's vocabulary size (e.g. `xgrammar.TokenizerInfo.from_huggingface(tokenizer,
            vocab_size=model.config.vocab_size)`).
        params: the constraint as `StructuredOutputsParams` (either logitgate class); or give its
            fields as keywords: `json=`, `json_object=`, `regex=`, `grammar=`, `choice=`,
            `structural_tag=`, `prefix_dict=`, `token_trie=`, `disable_any_whitespace=`.
        vocab_size: the grammar's vocabulary (default `tokenizer_info.vocab_size`); score columns
            past it (LM-head padding) are masked.
        backend: a registered grammar-backend name or a `GrammarBackend` to share (its compile
            cache); default: the engine `StructuredOutputManager` uses for the kind.
        stop_token_ids: the tokens allowed once the grammar finished or cannot continue (default
            the tokenizer_info's stop tokens; none known: every token).
        prompt_length: as for `TreeLogitsProcessor` (default: detected per generation).

    The constraint is compiled when the processor is built (ValueError with the reason if it is
    invalid). Each call copies the generated tokens to the host (grammar matchers run there).
    """

    def __init__(
        self,
        tokenizer_info: Any = None,
        params: Any = None,
        *,
        vocab_size: int | None = None,
        backend: str | GrammarBackend | None = None,
        stop_token_ids: Sequence[int] | None = None,
        prompt_length: int | None = None,
        **constraint: Any,
    ) -> None:
        if (params is None) == (not constraint):
            raise ValueError("give the constraint either as params or as keyword fields (json=, regex=, ...), exactly one way")
        params = StructuredOutputsParams(**constraint) if params is None else params
        if not isinstance(params, StructuredOutputsParams):
            raise ValueError(f"params must be a StructuredOutputsParams, got {type(params).__name__}")
        if vocab_size is None:
            if tokenizer_info is None:
                raise ValueError("vocab_size is needed when no tokenizer_info is given")
            vocab_size = int(tokenizer_info.vocab_size)
        if not is_integer(vocab_size) or vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        self.params = params
        self.vocab_size = vocab_size
        self._backend = self._make_backend(backend, params.kind, tokenizer_info, vocab_size)
        self._template = self._backend.compile(params.kind, params.spec, disable_any_whitespace=params.disable_any_whitespace)
        if stop_token_ids is None:
            stop_token_ids = list(tokenizer_info.stop_token_ids) if tokenizer_info is not None else []
        for t in stop_token_ids:
            if not 0 <= int(t) < vocab_size:
                raise ValueError(f"stop token id {t} is outside the vocabulary [0, {vocab_size})")
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self._end_row = (
            bitmask_from_token_ids([self.stop_token_ids], vocab_size)[0].numpy()
            if self.stop_token_ids
            else np.full(self._backend.allocate_token_bitmask(1).shape[1], -1, np.int32)
        )
        self._prompt = _PromptTracker(prompt_length)
        self._prompt_ids: torch.Tensor | None = None
        self._rows: dict[tuple[int, ...], _Row] = {}

    @staticmethod
    def _make_backend(backend: str | GrammarBackend | None, kind: str, tokenizer_info: Any, vocab_size: int) -> GrammarBackend:
        if backend is None or isinstance(backend, str):
            name = backend or DEFAULT_KIND_BACKENDS[kind]
            return get_grammar_backend_factory(name)(tokenizer_info=tokenizer_info, vocab_size=vocab_size)
        if not isinstance(backend, GrammarBackend):
            raise ValueError(f"backend must be a registered name or a GrammarBackend, got {type(backend).__name__}")
        if kind not in backend.kinds:
            raise ValueError(f"grammar backend {backend.name!r} cannot compile {kind!r} constraints")
        if backend.vocab_size != vocab_size:
            raise ValueError(f"the backend's vocab_size is {backend.vocab_size} but vocab_size is {vocab_size}")
        return backend

    def reset(self) -> None:
        """Forget the current generation (see `TreeLogitsProcessor.reset`)."""
        self._prompt.reset()
        self._prompt_ids = None
        self._rows = {}

    def _replay(self, tokens: Sequence[int]) -> _Row:
        row = _Row(self._template.fresh())
        for token in tokens:
            row.commit(token)
        return row

    def _fork(self, row: _Row, prefix: tuple[int, ...]) -> _Row:
        fork = getattr(row.grammar, "fork", None)
        if fork is None:  # engines without fork(): rebuild the state from the tokens
            return self._replay(prefix)
        twin = _Row(fork())
        twin.dead = row.dead
        return twin

    def _derive(self, keys: list[tuple[int, ...]]) -> dict[tuple[int, ...], _Row]:
        """The row of every distinct prefix: last call's row when unchanged, else the parent's
        (one token shorter) advanced, forked first when the parent has several children; a
        prefix without a known parent is replayed from the start state."""
        previous = self._rows
        children = Counter(k[:-1] for k in set(keys) if k and k not in previous and k[:-1] in previous)
        current: dict[tuple[int, ...], _Row] = {}
        for key in keys:
            if key in current:
                continue
            row = previous.get(key)
            if row is None and key and key[:-1] in previous:
                parent_key = key[:-1]
                children[parent_key] -= 1
                parent = previous[parent_key]
                row = parent if children[parent_key] == 0 else self._fork(parent, parent_key)
                row.commit(key[-1])
            elif row is None:
                row = self._replay(key)
            current[key] = row
        return current

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        _check_scores(input_ids, scores)
        start, new = self._prompt.observe(input_ids.shape[1])
        if not new and self._prompt.fixed is None and not _same(input_ids[:, :start], self._prompt_ids):
            # A new generation whose prompt is one column longer than the last input: this
            # processor syncs with the host anyway, so it checks the prompt exactly.
            self._prompt.reset()
            start, new = self._prompt.observe(input_ids.shape[1])
        if new:
            self._rows = {}
            self._prompt_ids = input_ids[:, :start].clone()
        keys = [tuple(row) for row in input_ids[:, start:].tolist()]  # the one host copy per step
        self._rows = self._derive(keys)
        bitmask = self._backend.allocate_token_bitmask(len(keys))
        first: dict[tuple[int, ...], int] = {}
        fill_grammars, fill_rows, copies, ended = [], [], [], []
        for i, key in enumerate(keys):
            if key in first:
                copies.append((i, first[key]))
                continue
            first[key] = i
            row = self._rows[key]
            if row.ended:
                ended.append(i)
            else:
                fill_grammars.append(row.grammar)
                fill_rows.append(i)
        if fill_grammars:
            self._backend.fill_bitmasks(fill_grammars, bitmask, fill_rows)
        host = bitmask.numpy()
        host[ended] = self._end_row
        for i, source in copies:
            host[i] = host[source]
        scores = scores.clone()
        vocab = scores.shape[1]
        apply_token_bitmask_inplace(scores, to_device(bitmask, scores.device), vocab_size=min(vocab, self.vocab_size))
        if vocab > self.vocab_size:
            scores[:, self.vocab_size :] = float("-inf")  # LM-head padding: no token of the grammar
        return scores



def tree_generation_kwargs(tree: TreeDFA, model: Any = None, *, eos_token_id: Any = None, prompt_length: int | None = None) -> dict[str, Any]:
    """`model.generate(inputs, **tree_generation_kwargs(tree, model), max_new_tokens=...)`: a
    TreeLogitsProcessor and `eos_token_id` = the EOS ids (`eos_token_id`, else the model's generation
    config's) plus the tree's end token. Hugging Face stops a row at any of them (greedy, sampling
    and beam search alike), so a tree whose end token is not EOS (e.g. Llama-3's `<|eot_id|>` or a
    newline) ends there instead of repeating its end token until `max_new_tokens`."""
    if eos_token_id is None and model is not None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        eos = []
    elif is_integer(eos_token_id):
        eos = [int(eos_token_id)]
    else:
        eos = [int(t) for t in eos_token_id]
    from transformers import LogitsProcessorList

    return {
        "logits_processor": LogitsProcessorList([TreeLogitsProcessor(tree, prompt_length)]),
        "eos_token_id": list(dict.fromkeys([*eos, int(tree.end_token_id)])),
    }
