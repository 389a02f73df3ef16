"""Speculative decoding for Hugging Face causal LMs through logitgate's reference decode loop
(`logitgate.generate.generate`): a draft model (or n-gram prompt lookup) proposes tokens, the
target verifies them with the rejection sampler, constraints (a TreeDFA, or a grammar through the
StructuredOutputManager) mask every draft and bonus position, and what the constraint fixes next
is drafted first (structured/forced.py): a tree's forced tokens and a grammar's mask-forced tokens
(always accepted), and, given the tokenizer, the tokenization of the string a grammar fixes
(verified under the mask like any draft). Greedy output equals the target's own greedy output.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...decode.generate import MAX_FORCED_TOKENS, GenerationStats, Request, generate
from ...sampling.params import SamplingParams
from ...structured.manager import StructuredOutputManager
from ...structured.params import StructuredOutputsParams
from ...structured.tree import TreeDFA

logger = logging.getLogger(__name__)

__all__ = ["SpeculativeOutput", "speculative_generate"]

DEFAULT_MAX_NEW_TOKENS = 32


@dataclass
class SpeculativeOutput:
    """`sequences`: int64 (B * num_return_sequences, W + T), Hugging Face's layout: each input row
    as given (list prompts left-padded), then its generated tokens, right-padded with the pad
    token to the longest. `token_ids`: the generated tokens of each sequence; `finish_reasons`:
    "stop" (an EOS / stop token), "length" (max_new_tokens) or "constraint" (the tree or grammar
    ended); `stats`: tokens, forward passes of target and draft, acceptance rate, forced tokens,
    seconds per phase."""

    sequences: torch.Tensor
    token_ids: list[list[int]]
    finish_reasons: list[str]
    stats: GenerationStats


def _config_value(model: Any, name: str) -> Any:
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(source, name, None) if source is not None else None
        if value is not None:
            return value
    return None


def _eos_ids(target: Any, eos_token_id: int | Sequence[int] | None) -> list[int]:
    value = eos_token_id if eos_token_id is not None else _config_value(target, "eos_token_id")
    if value is None:
        return []
    ids = [value] if isinstance(value, int) else list(value)
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"eos_token_id must be a token id or a list of them, got {value!r}")
    return ids


def _vocab_size(model: Any, what: str) -> int:
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"the {what} model has no config.vocab_size")
    return size


def _prompts(
    inputs: torch.Tensor | Sequence[Sequence[int]] | Sequence[int],
    attention_mask: torch.Tensor | None,
    pad_token_id: int,
    eos_ids: list[int],
) -> tuple[list[list[int]], torch.Tensor]:
    """(each row's prompt tokens, the input rows as returned in `sequences`)."""
    if isinstance(inputs, torch.Tensor):
        ids = inputs.unsqueeze(0) if inputs.dim() == 1 else inputs
        if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"inputs must be an int tensor (B, L), got {ids.dtype} with shape {tuple(inputs.shape)}")
        rows = ids.cpu().tolist()
        if attention_mask is not None:
            mask = attention_mask.unsqueeze(0) if attention_mask.dim() == 1 else attention_mask
            if tuple(mask.shape) != tuple(ids.shape):
                raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but inputs {tuple(ids.shape)}")
            prompts = [[t for t, m in zip(row, keep) if m] for row, keep in zip(rows, mask.cpu().tolist())]
        elif pad_token_id not in eos_ids:
            # As Hugging Face infers the mask: leading pad tokens are left padding.
            prompts = [row[next((i for i, t in enumerate(row) if t != pad_token_id), len(row)) :] for row in rows]
        else:
            prompts = rows
        return prompts, ids.cpu().long()
    if attention_mask is not None:
        raise ValueError("attention_mask applies to tensor inputs only")
    rows = list(inputs)
    if rows and all(isinstance(t, int) for t in rows):
        rows = [rows]  # one prompt given as a flat list
    prompts = [[int(t) for t in row] for row in rows]
    width = max((len(p) for p in prompts), default=0)
    padded = torch.full((len(prompts), width), pad_token_id, dtype=torch.int64)
    for i, p in enumerate(prompts):
        if p:
            padded[i, width - len(p) :] = torch.tensor(p, dtype=torch.int64)
    return prompts, padded


def _as_tree(tree: TreeDFA | Mapping[str, Any] | str | os.PathLike | None, vocab_size: int) -> TreeDFA | None:
    if tree is None or isinstance(tree, TreeDFA):
        return tree
    if isinstance(tree, os.PathLike):
        tree = os.fspath(tree)
    return TreeDFA.from_prefix_dict(tree, vocab_size=vocab_size, device="cpu")


def _real_tokens(tokenizer: Any, draft_tokenizer: Any, target_vocab: int, draft_vocab: int | None) -> int | None:
    """How many token ids are real (the tokenizers' tokens; ids past them are embedding-row padding),
    or None when no tokenizer was given. The draft's tokenizer must map every token to the same id
    as the target's; ValueError names the first token where they differ."""
    if tokenizer is None:
        if draft_tokenizer is not None:
            raise ValueError("draft_tokenizer needs tokenizer (the target's) to compare with")
        return None
    real = len(tokenizer)
    for what, size in (("target", target_vocab), ("draft", draft_vocab)):
        if size is not None and real > size:
            raise ValueError(f"the tokenizer has {real} tokens but the {what} model's vocab_size is {size}")
    if draft_tokenizer is not None and draft_tokenizer is not tokenizer:
        ours, theirs = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if ours != theirs:
            by_id = {i: t for t, i in ours.items()}
            draft_by_id = {i: t for t, i in theirs.items()}
            first = min(i for i in by_id.keys() | draft_by_id.keys() if by_id.get(i) != draft_by_id.get(i))
            raise ValueError(
                f"the tokenizers disagree on token id {first}: {by_id.get(first)!r} (target) vs "
                f"{draft_by_id.get(first)!r} (draft); a draft model must share the target's tokens"
            )
    return real


def _logits_fn(model: Any, width: int | None = None, real: int | None = None):
    """The model as the decode loop's callable: full logits, no KV cache built (the loop re-runs
    whole sequences). `width`: the columns the loop works with (the target's vocabulary): a draft's
    logits are cut or -inf-padded to it. `real`: columns from here on are padding, set to -inf so
    that they are never drafted nor sampled."""

    def run(input_ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=input_ids, use_cache=False).logits
        if width is not None and logits.shape[-1] != width:
            if logits.shape[-1] > width:
                logits = logits[..., :width]
            else:
                logits = torch.nn.functional.pad(logits, (0, width - logits.shape[-1]), value=float("-inf"))
        if real is not None and real < logits.shape[-1]:
            logits[..., real:] = float("-inf")
        return logits

    return run


def speculative_generate(
    target: Any,
    draft: Any,
    inputs: torch.Tensor | Sequence[Sequence[int]] | Sequence[int],
    *,
    attention_mask: torch.Tensor | None = None,
    tree: TreeDFA | Mapping[str, Any] | str | os.PathLike | None = None,
    structured_outputs: Any = None,
    tokenizer_info: Any = None,
    num_speculative_tokens: int = 4,
    ngram: int | None = None,
    jump_forward: bool = True,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    num_return_sequences: int = 1,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    tokenizer: Any = None,
    draft_tokenizer: Any = None,
) -> SpeculativeOutput:
    """Generate from `inputs` with `target`, speculating with `draft` (or `ngram` prompt lookup,
    `draft=None`; with neither it is plain decoding, still with jump-forward over a tree).

    inputs: a token tensor (B, L) (with `attention_mask`, or leading pad tokens taken as left
        padding) or lists of token ids.
    tree: a TreeDFA or a prefix-dict config (dict, JSON string or path); each prompt must end at
        the tree's root (for a prefix dict: with its start token).
    structured_outputs: a StructuredOutputsParams (json / regex / grammar / choice / ...) with
        `tokenizer_info`, the model's `xgrammar.TokenizerInfo`. One of tree / structured_outputs.
    temperature: 0 is greedy (the default; equals the target's greedy `generate`), else sampling
        with `top_k` (0: all) and `top_p`; `seed` makes it reproducible.
    eos_token_id / pad_token_id: default from the target's generation_config, then its config
        (the pad token falls back to the first EOS).
    max_new_tokens: default the target's generation_config.max_new_tokens, else 32.
    jump_forward: draft what the constraint fixes next (a tree's forced tokens; a grammar's
        mask-forced tokens, and with `tokenizer` the tokenization of its forced strings). The
        stats count them: forced_tokens, proposed_forced_drafts, accepted_forced_drafts.
    tokenizer / draft_tokenizer: the target's tokenizer, and the draft's when it has its own. With
        them, ids from `len(tokenizer)` on are embedding-row padding: masked in both models (never
        drafted, never sampled), and a draft whose vocab_size differs from the target's only by such
        padding is accepted once the two tokenizers are checked to give every token the same id.
    """
    if tree is not None and structured_outputs is not None:
        raise ValueError("give tree or structured_outputs, not both")
    if not isinstance(num_return_sequences, int) or num_return_sequences < 1:
        raise ValueError(f"num_return_sequences must be an int >= 1, got {num_return_sequences!r}")
    if num_return_sequences > 1 and temperature == 0:
        raise ValueError("num_return_sequences > 1 needs sampling (temperature > 0): greedy sequences would be identical")
    vocab_size = _vocab_size(target, "target")
    draft_vocab = _vocab_size(draft, "draft") if draft is not None else None
    real = _real_tokens(tokenizer, draft_tokenizer, vocab_size, draft_vocab)
    if draft_vocab is not None and draft_vocab != vocab_size and real is None:
        raise ValueError(
            f"the draft model's vocab_size {draft_vocab} differs from the target's {vocab_size}; when the "
            f"difference is padding (embedding rows past the tokenizer's tokens), pass tokenizer= (and "
            f"draft_tokenizer= if the draft has its own) so that the real tokens can be checked and the padding masked"
        )
    eos_ids = _eos_ids(target, eos_token_id)
    if pad_token_id is None:
        pad_token_id = _config_value(target, "pad_token_id")
    if pad_token_id is None:
        pad_token_id = eos_ids[0] if eos_ids else 0
    if max_new_tokens is None:
        max_new_tokens = _config_value(target, "max_new_tokens") or DEFAULT_MAX_NEW_TOKENS
    prompts, rows = _prompts(inputs, attention_mask, pad_token_id, eos_ids)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"inputs row {i} is empty (after removing padding)")
    constraint = None
    manager = None
    if structured_outputs is not None:
        if not isinstance(structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {type(structured_outputs).__name__}")
        constraint = structured_outputs
        grammar_vocab = int(tokenizer_info.vocab_size) if tokenizer_info is not None else vocab_size
        # Room in the grammar's bitmask for the step's drafts and the forced drafts before them.
        room = (num_speculative_tokens if draft is not None or ngram is not None else 0) + (MAX_FORCED_TOKENS if jump_forward else 0)
        encode = (lambda text: tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else None
        manager = StructuredOutputManager(
            tokenizer_info, vocab_size=grammar_vocab, num_speculative_tokens=max(room, num_speculative_tokens), max_workers=1, encode=encode,
        )
    params = SamplingParams(
        n=num_return_sequences, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        max_tokens=max_new_tokens, stop_token_ids=eos_ids[1:], structured_outputs=constraint,
    )
    requests = [Request(p, params, tree=_as_tree(tree, vocab_size)) for p in prompts]
    device = getattr(target, "device", None)
    try:
        result = generate(
            _logits_fn(target, real=real), requests, eos_token_id=eos_ids[0] if eos_ids else None,
            draft_model=_logits_fn(draft, vocab_size, real) if draft is not None else None,
            num_speculative_tokens=num_speculative_tokens,
            ngram=ngram, jump_forward=jump_forward, manager=manager, pad_token_id=pad_token_id, device=device,
        )
    finally:
        if manager is not None:
            manager.close()
    token_ids = [o.token_ids for o in result.outputs]
    longest = max((len(t) for t in token_ids), default=0)
    sequences = torch.full((len(token_ids), rows.shape[1] + longest), pad_token_id, dtype=torch.int64)
    sequences[:, : rows.shape[1]] = rows.repeat_interleave(num_return_sequences, dim=0)
    for i, tokens in enumerate(token_ids):
        if tokens:
            sequences[i, rows.shape[1] : rows.shape[1] + len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    logger.debug("speculative_generate: %s", result.stats.as_dict())
    return SpeculativeOutput(sequences.to(device) if device is not None else sequences, token_ids, [o.finish_reason for o in result.outputs], result.stats)
