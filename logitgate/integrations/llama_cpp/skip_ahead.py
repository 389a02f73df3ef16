"""Skip-ahead generation over llama-cpp-python's lower-level API (`Llama.eval`, the sampler chain).

What the constraint fixes next (structured/forced.py) is fed to the model with the sampled token
in one `eval` batch: one forward pass instead of one per token.
- mask-forced tokens (a tree's unique suffix, a grammar state with a single allowed token) are
  the only allowed ones: appended without sampling.
- string-forced tokens (the llama.cpp tokenization of the string a grammar fixes, e.g. `","age":`)
  are drafts: the model may write the same string in other tokens. With `Llama(logits_all=True)`
  (logits at every position of the batch) each draft's position is sampled with the same sampler
  chain and processor as the plain path, and the draft is kept while the sample equals it; the
  first sample that differs is emitted instead, and the KV cache is cut back past it. Every
  emitted token is still one sampler call over the constrained logits at its position, so greedy
  outputs equal token-by-token decoding and sampled ones follow the same distribution (exact:
  sampling, then comparing with a point-mass draft, is rejection sampling).
`forward_passes` counts llama.cpp decode calls after the prompt; the prompt's cached prefix is
reused (`prompt_passes` counts the rest)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from ...structured.forced import ForcedTokens
from .constraint import LlamaConstraint

MAX_FORCED_TOKENS = 64  # per batch; the rest follows in the next one


@dataclass
class SkipAheadResult:
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" (a stop token), "length" (max_tokens)
    forward_passes: int  # decode calls after the prompt
    prompt_passes: int
    forced_tokens: int  # tokens appended without sampling (mask-forced)
    sampled_tokens: int
    seconds: float
    processor: Any = field(repr=False, default=None)
    proposed_drafts: int = 0  # string-forced drafts evaluated
    accepted_drafts: int = 0  # of them, emitted

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("inf")


def _reuse_prompt_cache(llm: Any, prompt_ids: list[int]) -> int:
    """Evaluate the prompt, keeping the KV cache of the longest prefix it shares with what the model
    last evaluated (as llama-cpp-python's own generate does); at least the last prompt token is
    evaluated again, for fresh logits. Returns how many tokens were evaluated."""
    cached = llm.input_ids[: llm.n_tokens]
    keep = 0
    limit = min(len(cached), len(prompt_ids) - 1)
    while keep < limit and cached[keep] == prompt_ids[keep]:
        keep += 1
    if keep == 0:
        llm.reset()
    else:
        llm.n_tokens = keep  # eval() drops the KV cache past n_tokens first
    llm.eval(prompt_ids[keep:])
    return len(prompt_ids) - keep


def generate(
    llm: Any,
    prompt: str | list[int],
    constraint: LlamaConstraint,
    *,
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    skip_ahead: bool = True,
    add_bos: bool = True,
) -> SkipAheadResult:
    """Generate from `prompt` (text, or token ids used as given) under `constraint`. The sampler
    chain is llama-cpp-python's (`temperature` 0: greedy) with the constraint's processor first."""

    if constraint.info.llm is not llm:
        raise ValueError("the constraint was compiled for another Llama instance; build it with constrain(llm, ...)")
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    prompt_ids = llm.tokenize(prompt.encode("utf-8"), add_bos=add_bos, special=True) if isinstance(prompt, str) else list(prompt)
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_ids) + max_tokens > llm.n_ctx():
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceed the context ({llm.n_ctx()})")
    if getattr(llm, "draft_model", None) is not None:
        raise ValueError("skip-ahead generate() does not use draft models; use llm.create_completion for drafts")
    processor = constraint.logits_processor()
    sampler_args = dict(top_k=top_k, top_p=top_p, min_p=min_p, temp=temperature)
    # String-forced drafts need the logits of every position of a batch (Llama(logits_all=True));
    # the flag is cleared while nothing is drafted (the prompt, batches without drafts), so those
    # batches compute their last row only, as without it.
    drafting = skip_ahead and bool(getattr(llm, "_logits_all", False))
    try:
        if drafting:
            llm._logits_all = False
        return _generate(llm, prompt_ids, constraint, processor, sampler_args, max_tokens, seed, skip_ahead, drafting)
    finally:
        if drafting:
            llm._logits_all = True


def _generate(llm, prompt_ids, constraint, processor, sampler_args, max_tokens, seed, skip_ahead, drafting) -> SkipAheadResult:
    from llama_cpp import LogitsProcessorList

    stops = set(constraint.info.stop_token_ids)
    if seed is not None:
        llm.set_seed(seed)
    start = time.perf_counter()
    evaluated = _reuse_prompt_cache(llm, prompt_ids)
    processor.begin(prompt_ids)
    sampler = llm._init_sampler(**sampler_args, repeat_penalty=1.0, logits_processor=LogitsProcessorList([processor]))
    out: list[int] = []
    passes = forced_total = proposed = accepted = 0
    finish = "length"
    row, pending = -1, None  # the batch row whose logits sample the next token; a token sampled already
    while len(out) < max_tokens:
        token = pending if pending is not None else sampler.sample(llm._ctx, row)
        pending = None
        if processor.error is not None:
            raise RuntimeError(f"the constraint failed during generation: {processor.error}") from processor.error
        out.append(token)
        if token in stops:
            finish = "stop"
            break
        forced = processor.forced(out, min(max_tokens - len(out), MAX_FORCED_TOKENS)) if skip_ahead else ForcedTokens()
        mask_forced = forced.mask_forced
        cut = next((i for i, t in enumerate(mask_forced) if t in stops), None)
        if cut is not None:
            out += mask_forced[: cut + 1]
            forced_total += cut + 1
            finish = "stop"
            break
        out += mask_forced
        forced_total += len(mask_forced)
        if len(out) >= max_tokens:
            break
        drafts = forced.string_forced[: max_tokens - len(out)] if drafting else []
        base = llm.n_tokens + 1 + len(mask_forced)  # tokens before the first draft's position
        if drafting:
            llm._logits_all = bool(drafts)
        llm.eval([token, *mask_forced, *drafts])
        passes += 1
        processor.expect_drafts(base, len(drafts))  # the next calls sample rows base - 1, base, ...
        row = len(mask_forced)
        kept = 0
        for draft in drafts:
            sample = sampler.sample(llm._ctx, row)
            if processor.error is not None:
                raise RuntimeError(f"the constraint failed during generation: {processor.error}") from processor.error
            if sample != draft:
                pending = sample  # emitted in place of the draft
                break
            kept += 1
            row += 1
            out.append(draft)
            if draft in stops or len(out) >= max_tokens:
                finish = "stop" if draft in stops else "length"
                break
        proposed += len(drafts)
        accepted += kept
        if kept < len(drafts):
            llm.n_tokens = base + kept  # the rejected drafts leave the KV cache with the next eval
        if finish == "stop" or len(out) >= max_tokens:
            break
    seconds = time.perf_counter() - start
    text = llm.detokenize([t for t in out if t not in stops]).decode("utf-8", errors="replace")
    return SkipAheadResult(
        tokens=out, text=text, finish_reason=finish, forward_passes=passes,
        prompt_passes=math.ceil(evaluated / llm.n_batch), forced_tokens=forced_total,
        sampled_tokens=len(out) - forced_total, seconds=seconds, processor=processor,
        proposed_drafts=proposed, accepted_drafts=accepted,
    )
