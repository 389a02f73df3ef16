"""A reference batched decode loop over any model callable, with logitgate doing every step between
the logits and the tokens: constraints (TreeDFA, or grammars through the StructuredOutputManager),
sampling, and speculative decoding verified by the rejection sampler.

One code path: plain decoding is speculative decoding with zero drafts. A step proposes drafts per
sequence — what the constraint fixes next first (structured/forced.py: a tree's unique
continuation and the tokens a grammar's mask allows alone, always accepted; then the tokenization
of the string a grammar fixes, e.g. `","age":`, a point-mass draft the model may still refuse by
choosing another tokenization), then a draft model's proposals or n-gram prompt-lookup tokens —
runs the target once over every sequence plus its drafts, masks every draft and bonus position with
the constraint, samples the bonus token, and verifies the drafts with `rejection_sample`. Emitted
tokens follow the constrained target exactly: a forced draft is verified like any other.

A model is any callable `input_ids (B, L) int64 -> logits (B, L, V)` (or an object with `.logits`,
as Hugging Face causal LMs return). The loop re-runs the model over whole right-padded sequences
each step (no KV cache: simple, and exact for causal models); a model may cache internally.
"""
from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..sampling.ops import random_sample
from ..sampling.params import SAMPLING_EPS, SamplingParams
from ..sampling.rejection import parse_output, rejection_sample
from ..sampling.sampler import Sampler, SamplingMetadata, make_generator
from ..sampling.spec_constraint import constrain_spec_logits
from ..structured.bitmask import apply_token_bitmask_inplace
from ..structured.constraint_state import GrammarConstraint, TreeConstraint, fill_constraint_rows
from ..structured.forced import ForcedTokens
from ..structured.manager import StructuredOutputManager
from ..structured.tree import TreeDFA
from ..structured.tree.prompt import warn_prompt_start
from .sparse_tree_step import tree_spec_step, use_sparse_verification

Model = Callable[[torch.Tensor], torch.Tensor]
MAX_FORCED_TOKENS = 32  # forced tokens appended per step (each costs one position of the target pass)
UNSUPPORTED_IN_LOOP = ("min_p", "logit_bias", "min_tokens")


@dataclass
class Request:
    """A prompt and how to continue it. `tree` constrains with a TreeDFA (the prompt must end at the
    tree's root, e.g. with its start token); `params.structured_outputs` constrains through the
    StructuredOutputManager passed to `generate`."""

    prompt: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    tree: TreeDFA | None = None


@dataclass
class SequenceOutput:
    request_index: int
    sample_index: int  # 0 .. params.n - 1
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token), "length" (max_tokens), "constraint" (the constraint ended)


@dataclass
class GenerationStats:
    tokens: int = 0
    steps: int = 0
    target_forward_passes: int = 0  # batched calls of the target model
    draft_forward_passes: int = 0
    proposed_drafts: int = 0  # draft-model and n-gram drafts (forced tokens counted apart)
    accepted_drafts: int = 0
    forced_tokens: int = 0  # mask-forced tokens emitted through verification (always accepted)
    proposed_forced_drafts: int = 0  # string-forced drafts (a grammar's fixed string, tokenized)
    accepted_forced_drafts: int = 0
    sequence_steps: int = 0  # sum over steps of the sequences decoded in that step
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_drafts / self.proposed_drafts if self.proposed_drafts else None

    @property
    def tokens_per_sequence_step(self) -> float:
        """Tokens emitted per sequence per target pass (1.0 for plain decoding)."""
        return self.tokens / self.sequence_steps if self.sequence_steps else 0.0

    def as_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "steps": self.steps,
            "target_forward_passes": self.target_forward_passes,
            "draft_forward_passes": self.draft_forward_passes,
            "proposed_drafts": self.proposed_drafts,
            "accepted_drafts": self.accepted_drafts,
            "acceptance_rate": self.acceptance_rate,
            "forced_tokens": self.forced_tokens,
            "proposed_forced_drafts": self.proposed_forced_drafts,
            "accepted_forced_drafts": self.accepted_forced_drafts,
            "tokens_per_sequence_step": self.tokens_per_sequence_step,
            "seconds": dict(self.seconds),
        }


@dataclass
class GenerationResult:
    outputs: list[SequenceOutput]
    stats: GenerationStats


@dataclass
class _Seq:
    request_index: int
    sample_index: int
    params: SamplingParams
    tokens: list[int]
    constraint: TreeConstraint | GrammarConstraint | None
    generator: torch.Generator | None
    stops: set[int]
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class _Timer:
    def __init__(self, stats: GenerationStats, name: str) -> None:
        self.stats, self.name = stats, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.stats.seconds[self.name] += time.perf_counter() - self.start


def _logits_of(model: Model, input_ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids)
    logits = getattr(out, "logits", out)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(f"the model must return logits of shape (B, L, V) for input (B, L) = {tuple(input_ids.shape)}")
    return logits


def _run(model: Model, sequences: Sequence[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Right-padded batch through a causal model: logits (B, L, V) (padding sits after every real token)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.int64)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.int64)
    with torch.no_grad():
        return _logits_of(model, ids.to(device)).float()


def _ngram_drafts(tokens: Sequence[int], n: int, k: int) -> list[int]:
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the last n tokens."""
    if k <= 0 or len(tokens) <= n:
        return []
    tail = list(tokens[-n:])
    for start in range(len(tokens) - n - 1, -1, -1):
        if list(tokens[start : start + n]) == tail:
            return list(tokens[start + n : start + n + k])
    return []


def _check_request(i: int, request: Request, manager: StructuredOutputManager | None) -> None:
    params = request.params
    if not isinstance(params, SamplingParams):
        raise ValueError(f"requests[{i}].params must be a SamplingParams, got {type(params).__name__}")
    if not request.prompt:
        raise ValueError(f"requests[{i}] has an empty prompt")
    if params.max_tokens is None:
        raise ValueError(f"requests[{i}]: max_tokens must be set for the reference loop")
    for name in UNSUPPORTED_IN_LOOP:
        default = SamplingParams.__dataclass_fields__[name].default
        if getattr(params, name) not in (default, None):
            raise ValueError(f"requests[{i}]: {name} is not supported by the reference decode loop; use Sampler with its logits processors")
    if request.tree is not None and params.structured_outputs is not None:
        raise ValueError(f"requests[{i}] has both a tree and structured_outputs; give one constraint")
    if request.tree is not None:
        warn_prompt_start(request.tree, request.prompt, f"requests[{i}]")
    if params.structured_outputs is not None and manager is None:
        raise ValueError(f"requests[{i}] has structured_outputs but no StructuredOutputManager was passed")


def generate(
    model: Model,
    requests: Sequence[Request],
    *,
    eos_token_id: int | None,
    draft_model: Model | None = None,
    num_speculative_tokens: int = 0,
    ngram: int | None = None,
    jump_forward: bool = True,
    manager: StructuredOutputManager | None = None,
    pad_token_id: int = 0,
    device: torch.device | str | None = None,
    sparse_max_fraction: float | None = None,
) -> GenerationResult:
    """Generate every request (each `params.n` times) in one batch; see the module docstring.

    num_speculative_tokens: drafts per step from `draft_model` or, with `ngram=n`, from prompt
    lookup (n-gram drafts carry no probabilities: vLLM's point-mass mode). jump_forward: append
    what the constraint fixes next as drafts (structured/forced.py): mask-forced tokens (accepted
    with probability 1) and a grammar's string-forced tokens (point-mass drafts, verified under the
    mask; tokenized with the manager's `encode`; at most the manager's num_speculative_tokens
    less num_speculative_tokens a step). Both save target passes when accepted.
    sparse_max_fraction: the tree-decode crossover (structured/tree/candidates.py): the sequences
    of a TreeDFA sample and verify over the tree's candidates (rows allowing at most this fraction
    of the vocabulary; with drafts, while the widest of the tree's rows does), in any batch: other
    sequences (grammars, no constraint) are masked and sampled over the vocabulary in the same step
    (None: the measured default, or LOGITGATE_TREE_SPARSE_MAX_FRACTION).
    """
    if draft_model is not None and ngram is not None:
        raise ValueError("give draft_model or ngram, not both")
    if num_speculative_tokens < 0 or num_speculative_tokens > 128:
        raise ValueError(f"num_speculative_tokens must be in [0, 128], got {num_speculative_tokens}")
    if ngram is not None and ngram < 1:
        raise ValueError(f"ngram must be >= 1, got {ngram}")
    if manager is not None and (draft_model is not None or ngram is not None) and manager.num_speculative_tokens < num_speculative_tokens:
        raise ValueError(
            f"the StructuredOutputManager allows {manager.num_speculative_tokens} drafts per step but "
            f"num_speculative_tokens={num_speculative_tokens}; build it with num_speculative_tokens>={num_speculative_tokens}"
        )
    device = torch.device(device) if device is not None else torch.device("cpu")
    stats = GenerationStats()
    seqs: list[_Seq] = []
    for r, request in enumerate(requests):
        _check_request(r, request, manager)
        for s in range(request.params.n):
            constraint = None
            if request.tree is not None:
                constraint = TreeConstraint(request.tree)
            elif request.params.structured_outputs is not None:
                request_id = f"logitgate-generate-{id(seqs)}-{r}-{s}"
                manager.add_request(request_id, request.params.structured_outputs)
                constraint = GrammarConstraint(manager, request_id)
            seed = request.params.seed
            seqs.append(
                _Seq(
                    r, s, request.params, list(request.prompt), constraint,
                    make_generator(seed + s, device) if seed is not None else None,
                    request.params.all_stop_token_ids(eos_token_id),
                )
            )
    sampler = Sampler()
    try:
        # The vocabulary (logits width) is needed before the first target pass to lay out draft rows.
        vocab = _run(model, [seqs[0].tokens[-1:]], pad_token_id, device).shape[-1] if seqs else 0
        while active := [q for q in seqs if q.finish_reason is None]:
            _step(model, draft_model, active, stats, sampler, num_speculative_tokens, ngram, jump_forward, pad_token_id, device, vocab, sparse_max_fraction)
    finally:
        for q in seqs:
            if isinstance(q.constraint, GrammarConstraint):
                manager.remove_request(q.constraint.request_id)
    outputs = [SequenceOutput(q.request_index, q.sample_index, q.generated, q.finish_reason) for q in seqs]
    return GenerationResult(outputs, stats)


def _propose(draft_model, active, stats, k, ngram, jump_forward, pad, device, vocab) -> tuple[list[list[int]], list[ForcedTokens], torch.Tensor | None]:
    """Drafts per sequence, the forced ones among them (each sequence's drafts start with its
    ForcedTokens), and draft probabilities (rows in the flattened draft layout) when a draft model
    proposed them."""
    budgets = [q.params.max_tokens - len(q.generated) - 1 for q in active]
    drafts: list[list[int]] = []
    forced_per_seq: list[ForcedTokens] = []
    speculating = k if ngram is not None or draft_model is not None else 0
    for q, budget in zip(active, budgets):
        cap = min(budget, MAX_FORCED_TOKENS)
        if isinstance(q.constraint, GrammarConstraint):  # the manager's bitmask takes this many drafts a row
            cap = min(cap, q.constraint.manager.num_speculative_tokens - speculating)
        forced = q.constraint.forced(cap) if jump_forward and q.constraint and cap > 0 else ForcedTokens()
        forced_per_seq.append(forced)
        drafts.append(list(forced.tokens))
    num_forced = [len(d) for d in drafts]
    if ngram is not None:
        for q, d, budget in zip(active, drafts, budgets):
            if _ended(q, d):
                continue  # nothing follows a stop token or the end of the constraint
            extra = _ngram_drafts(q.tokens + d, ngram, min(k, budget - len(d)))
            if q.constraint is not None and extra:
                extra = extra[: q.constraint.valid_prefix(d + extra) - len(d)]
                end = q.constraint.end_of(d + extra) if extra else None
                extra = extra if end is None else extra[: end - len(d)]
            d.extend(extra)
        return drafts, forced_per_seq, None
    if draft_model is None or k == 0:
        return drafts, forced_per_seq, None
    probs: list[list[torch.Tensor]] = [[_one_hot(t, vocab, device) for t in d] for d in drafts]
    for _ in range(k):
        rows = [
            i for i, (d, b) in enumerate(zip(drafts, budgets))
            if len(d) < b and len(d) < num_forced[i] + k and not _ended(active[i], d)
        ]
        if not rows:
            break
        with _Timer(stats, "draft_model"):
            logits = _run(draft_model, [active[i].tokens + drafts[i] for i in rows], pad, device)
        stats.draft_forward_passes += 1
        last = torch.stack([logits[j, len(active[i].tokens) + len(drafts[i]) - 1] for j, i in enumerate(rows)])
        with _Timer(stats, "masking"):
            constraints = [active[i].constraint for i in rows]
            if any(c is not None for c in constraints):
                masks, _ = fill_constraint_rows(constraints, [drafts[i] for i in rows], vocab, device)
                # Each row's last mask row (its state after its drafts so far): a running total.
                ends = torch.tensor(list(itertools.accumulate(1 + len(drafts[i]) for i in rows))) - 1
                apply_token_bitmask_inplace(last, masks[ends.to(device)])
        with _Timer(stats, "sampling"):
            temps = torch.tensor([max(active[i].params.temperature, 0.0) for i in rows], device=device)
            greedy = temps < SAMPLING_EPS
            q = torch.softmax(last / torch.where(greedy, 1.0, temps).unsqueeze(1), dim=-1)
            gens = {j: active[i].generator for j, i in enumerate(rows) if active[i].generator is not None and not greedy[j]}
            argmax = last.argmax(-1)
            sampled = argmax if bool(greedy.all()) else torch.where(greedy, argmax, random_sample(q.clone(), gens))
            tokens = sampled.tolist()
        for j, i in enumerate(rows):
            drafts[i].append(tokens[j])
            probs[i].append(_one_hot(tokens[j], vocab, device) if greedy[j] else q[j])
    flat = [p for per_seq in probs for p in per_seq]
    return drafts, forced_per_seq, (torch.stack(flat) if flat else None)


def _ended(q: _Seq, drafts: list[int]) -> bool:
    """Whether nothing may follow `drafts`: they end with a stop token or finish the constraint."""
    if not drafts:
        return False
    return drafts[-1] in q.stops or (q.constraint is not None and q.constraint.end_of(drafts) is not None)


def _one_hot(token: int, vocab: int, device: torch.device) -> torch.Tensor:
    row = torch.zeros(vocab, device=device)
    row[token] = 1.0
    return row


def _tree_groups(active: list[_Seq], device: torch.device) -> list[tuple[TreeDFA, list[int]]]:
    """(tree, indices into active) for every TreeDFA the active sequences decode under (trees on
    the logits' device only: the others are masked densely)."""
    groups: dict[int, tuple[TreeDFA, list[int]]] = {}
    for i, q in enumerate(active):
        if isinstance(q.constraint, TreeConstraint) and q.constraint.tree.device == device:
            groups.setdefault(id(q.constraint.tree), (q.constraint.tree, []))[1].append(i)
    return list(groups.values())


def _metadata(active: list[_Seq], index: list[int], device: torch.device) -> SamplingMetadata:
    """Sampling metadata of the sequences active[index] (row j is active[index[j]])."""
    generators = {j: active[i].generator for j, i in enumerate(index) if active[i].generator is not None}
    return SamplingMetadata.from_params([active[i].params for i in index], device=device, generators=generators)


def _step(model, draft_model, active, stats, sampler, k, ngram, jump_forward, pad, device, vocab, sparse_max_fraction=None) -> None:
    """One target pass over every active sequence, then per sequence its emitted tokens. Sequences
    are verified independently, so the batch splits: the sequences of each tree whose rows pay
    sparse (decode/sparse_tree_step.py: candidates, the plan's crossover) go through tree_spec_step, the
    rest (grammars, no constraint, trees past the crossover) through the masked dense rows."""
    stats.steps += 1
    stats.sequence_steps += len(active)
    drafts, forced, draft_probs = _propose(draft_model, active, stats, k, ngram, jump_forward, pad, device, vocab)
    with _Timer(stats, "target_model"):
        logits = _run(model, [q.tokens + d for q, d in zip(active, drafts)], pad, device)
    stats.target_forward_passes += 1
    seq_rows = [logits[i, len(q.tokens) - 1 : len(q.tokens) + len(d)] for i, (q, d) in enumerate(zip(active, drafts))]
    draft_starts = list(itertools.accumulate((len(d) for d in drafts), initial=0))

    def sub_probs(index: list[int]) -> torch.Tensor | None:
        if draft_probs is None or len(index) == len(active):
            return draft_probs
        at = [r for i in index for r in range(draft_starts[i], draft_starts[i + 1])]
        return draft_probs[torch.tensor(at, dtype=torch.int64, device=draft_probs.device)]

    emitted: list[list[int] | None] = [None] * len(active)
    dense = [True] * len(active)
    for tree, index in _tree_groups(active, device):
        states = [s for i in index for s in active[i].constraint.walk_states(drafts[i])]
        if any(drafts[i] for i in index) and not use_sparse_verification(tree, states, logits.shape[-1], sparse_max_fraction):
            continue  # verification shares one layout as wide as the widest row: dense pays here
        with _Timer(stats, "tree_step"):
            out = tree_spec_step(
                sampler, torch.cat([seq_rows[i] for i in index]), tree, states, [drafts[i] for i in index],
                _metadata(active, index, device), draft_probs=sub_probs(index), sparse_max_fraction=sparse_max_fraction,
            )
        for i, tokens in zip(index, out):
            emitted[i], dense[i] = tokens, False
    rest = [i for i in range(len(active)) if dense[i]]
    if rest:
        for i, tokens in zip(rest, _dense_step([active[i] for i in rest], [drafts[i] for i in rest], [seq_rows[i] for i in rest],
                                               sub_probs(rest), sampler, _metadata(active, rest, device), stats, device)):
            emitted[i] = tokens
    _record(active, drafts, forced, emitted, stats)


def _dense_step(active, drafts, seq_rows, draft_probs, sampler, metadata, stats, device) -> list[list[int]]:
    """Mask every draft and bonus row over the vocabulary, sample the bonus tokens, verify the drafts."""
    rows = torch.cat(seq_rows)
    counts = [len(d) for d in drafts]
    flat_drafts = torch.tensor([t for d in drafts for t in d], dtype=torch.int64, device=device)
    with _Timer(stats, "masking"):
        bitmask, constrained = fill_constraint_rows([q.constraint for q in active], drafts, rows.shape[-1], device)
        spec = constrain_spec_logits(rows, bitmask, flat_drafts, counts, rows=constrained)
    with _Timer(stats, "sampling"):
        bonus = sampler(spec.bonus_logits.clone(), metadata).sampled_token_ids.squeeze(1)
    with _Timer(stats, "verification"):
        out = rejection_sample(
            flat_drafts, counts, spec.target_logits, bonus, draft_probs=draft_probs,
            temperature=metadata.temperature, top_k=metadata.top_k, top_p=metadata.top_p, generators=metadata.generators,
        )
    return parse_output(out, rows.shape[-1])


def _record(active, drafts, forced, emitted, stats) -> None:
    """Append each sequence's emitted tokens; count drafts, acceptances and forced tokens."""
    for q, d, f, tokens in zip(active, drafts, forced, emitted):
        accepted_drafts = min(len(tokens) - 1, len(d))
        stats.forced_tokens += min(f.num_mask_forced, accepted_drafts)
        stats.proposed_forced_drafts += len(f) - f.num_mask_forced
        stats.accepted_forced_drafts += max(0, min(accepted_drafts, len(f)) - f.num_mask_forced)
        stats.proposed_drafts += len(d) - len(f)
        stats.accepted_drafts += max(0, accepted_drafts - len(f))
        end = q.constraint.end_of(tokens) if q.constraint is not None else None
        kept = _keep(q, tokens if end is None else tokens[:end])  # nothing after the constraint's end
        stats.tokens += len(kept)
        if q.constraint is not None:
            q.constraint.commit(kept)
            if q.finish_reason is None and q.constraint.is_terminated():
                q.finish_reason = "constraint"


def _keep(q: _Seq, tokens: list[int]) -> list[int]:
    """Append emitted tokens up to a stop token or max_tokens; set the finish reason."""
    kept = []
    for t in tokens:
        kept.append(t)
        q.generated.append(t)
        q.tokens.append(t)
        if t in q.stops:
            q.finish_reason = "stop"
            break
        if len(q.generated) >= q.params.max_tokens:
            q.finish_reason = "length"
            break
    return kept

