"""The Backend interface: the one place that knows which device logitgate runs on.

`sampling/` and `structured/` call `backend.<op>(...)` on already-validated tensors; each backend
decides which kernel runs and reports that decision through `capabilities` and `kernels()`.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch

from . import reference
from .formats import candidate_column_tokens
from .reference import apply_top_k_top_p_reference
from .sampling_rules import exponential_race, fallback_tokens, fill_exponential, undefined_prob_rows


class CandidateRows(NamedTuple):
    """Rows of the sparse layout as the candidate kernels read them: layout row i is logits row
    rows[i], whose allowed tokens are allow_tok[starts[i] : starts[i] + widths[i]] (sorted), and
    `width` (>= every widths[i]) is the layout's column count. rows/starts/widths are int64 (n,) and
    allow_tok int32, all on the logits' device. A NamedTuple, so a kernel takes `*candidates`."""

    rows: torch.Tensor
    starts: torch.Tensor
    widths: torch.Tensor
    allow_tok: torch.Tensor
    width: int


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, so callers never test device types themselves."""

    native_bitmask: bool  # the bitmask is applied on the device (no host round trip)
    torch_compile: bool  # torch.compile produces kernels for this device
    triton: bool  # Triton kernels run on this device (triton / triton-ascend / interpreter)
    side_streams: bool  # work can be queued on a second stream and joined with an event
    vector_cores: int | None = None  # Ascend vector cores (launch grid size); None elsewhere

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


NOISE_EXPONENTIAL = "exponential"  # q ~ Exp(1), float32 (B, V): the exponential trick argmax(p / q)
NOISE_UNIFORM = "uniform"  # u ~ U[0, 1), float64 (B,): one inverse-CDF draw per row
NOISE_PHILOX = "philox"  # int64 (B,) seeds: the kernel generates each row's Exp(1) noise (triton/philox.py)


@dataclass
class SamplingNoise:
    """Random numbers for one `random_sample` call, drawn ahead of time by `draw_sampling_noise`.

    `event` marks the end of the draw on the backend's side stream (None where the draw is
    synchronous); the sampling step waits on it on the device, never on the host. A noise object is
    used once (`consumed`), so a reused draw cannot silently correlate two steps.
    """

    kind: str
    values: torch.Tensor
    event: Any = None
    consumed: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)


class Backend(ABC):
    """A device and the kernels logitgate uses on it. Obtain one with `get_backend()`."""

    name: str = "abstract"

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abstractmethod
    def kernels(self) -> dict[str, str]:
        """Operation name -> the kernel this backend will run for it (shown by `logitgate doctor`)."""

    def check_on_device(self, **tensors: torch.Tensor | None) -> None:
        """ValueError naming the first of `tensors` (None skipped) that is not on this backend's
        device. The kernel entry points of the device backends call it: the public functions check
        their inputs, but a caller of a kernel (or a layer that built an index on the wrong device)
        would otherwise get the kernel's own failure (Triton: "Pointer argument cannot be accessed
        from Triton (cpu tensor?)")."""
        for name, tensor in tensors.items():
            if tensor is not None and tensor.device != self.device:
                raise ValueError(f"{name} is on {tensor.device} but backend {self.name!r} runs on {self.device}")

    # ---- kernels (inputs are validated by the public functions that call these) ----

    @abstractmethod
    def apply_token_bitmask(
        self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None, vocab_size: int
    ) -> None:
        """In place: logits[r, t] = -inf where bit t of bitmask[r] is 0, for t < vocab_size and each
        selected row r (`rows` selects rows of both tensors; None = all rows)."""

    def fill_tree_bitmask(
        self,
        bitmask: torch.Tensor,
        states: torch.Tensor,
        allow_start: torch.Tensor,
        allow_tok: torch.Tensor,
        fill_width: torch.Tensor,
        max_width: int,
        dense_rows: torch.Tensor | None,
        dense_slot: torch.Tensor | None,
    ) -> None:
        """bitmask[r] := the allowed tokens of tree state states[r] (see
        reference.fill_tree_bitmask_reference); on the device, no host sync."""
        reference.fill_tree_bitmask_reference(bitmask, states, allow_start, allow_tok, fill_width, max_width, dense_rows, dense_slot)

    def gather_candidate_logits(self, logits: torch.Tensor, candidates: CandidateRows) -> torch.Tensor:
        """float32 (n, width): row i holds logits[rows[i]] at the tokens allow_tok[starts[i] :
        starts[i] + widths[i]], then -inf (see reference.gather_candidate_logits_reference); no
        host sync."""
        return reference.gather_candidate_logits_reference(logits, *candidates)

    def candidate_argmax(self, logits: torch.Tensor, candidates: CandidateRows) -> torch.Tensor:
        """int64 (n,): the greedy token of each row over its allowed tokens (see
        reference.candidate_argmax_reference). Default: this backend's gather, then its argmax,
        then the column's token; no host sync."""
        if candidates.width == 0:
            return torch.zeros(candidates.rows.shape[0], dtype=torch.int64, device=logits.device)
        columns = self.argmax(self.gather_candidate_logits(logits, candidates))
        return candidate_column_tokens(columns, candidates.starts, candidates.widths, candidates.allow_tok)

    # Whether `sample_candidates` is a fused kernel that pays over gathering the layout and running
    # the Sampler's ops on it (sampling/ and structured/ pick the fused draw only where it is).
    fused_candidate_sampling: bool = False
    # Whether `sample_from_logits` may draw in one go (else it always returns None and callers skip it).
    fused_logit_sampling: bool = False

    def sample_candidates(
        self,
        logits: torch.Tensor,
        candidates: CandidateRows,
        temperature: torch.Tensor,
        greedy: torch.Tensor | None,
        top_k: torch.Tensor | None,
        top_p: torch.Tensor | None,
        uniform: torch.Tensor,
    ) -> torch.Tensor:
        """int64 (n,): one token per row of the sparse layout, greedy or drawn with temperature,
        top-k, top-p and one float64 uniform per row (see reference.sample_candidates_reference);
        no host sync. Default: the torch reference."""
        return reference.sample_candidates_reference(logits, *candidates, temperature, greedy, top_k, top_p, uniform)

    def keep_candidate_logits(self, logits: torch.Tensor, candidates: CandidateRows) -> None:
        """In place: rows[i] of logits keeps only the tokens allow_tok[starts[i] : starts[i] +
        widths[i]], the rest becomes -inf (see reference.keep_candidate_logits_reference)."""
        reference.keep_candidate_logits_reference(logits, *candidates)

    # ---- speculative decoding: rejection sampling (layout: formats.py; semantics: reference/rejection.py) ----

    # The noise `rejection_recover` consumes: "uniform" = one float64 per request (inverse CDF, cheap
    # where the vocabulary is walked serially), "exponential" = float32 (B, V) Exp(1) draws for the
    # race argmax(w / q), which parallelises without a sync and can be drawn on a side stream;
    # NOISE_PHILOX = int64 (B,) seeds from which the kernel generates that Exp(1) noise itself.
    recovery_noise: str = "exponential"

    def rejection_verify(
        self,
        cu_num_draft_tokens: torch.Tensor,
        token_request: torch.Tensor,
        draft_token_ids: torch.Tensor,
        target_logits: torch.Tensor,
        temperature: torch.Tensor | None,
        draft_probs: torch.Tensor | None,
        uniform: torch.Tensor | None,
        noise: torch.Tensor | None,
        bonus: torch.Tensor,
        width: int,
        all_greedy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(output int32 (B, width), accepted int32 (B,)) of rejection sampling without top-k/top-p,
        in one go: `temperature` per request (B,) (0 = a greedy request; None = every request at 1,
        or every request greedy with all_greedy, when uniform and noise are unused), `noise` of kind
        `recovery_noise`, token_request the request of each draft (N,). None where this backend
        verifies step by step (`rejection_greedy_accept`, `rejection_random_accept`,
        `rejection_recover`), which the caller then does. Default: None."""
        return None

    def rejection_greedy_accept(
        self,
        cu_num_draft_tokens: torch.Tensor,
        draft_token_ids: torch.Tensor,
        target_logits: torch.Tensor,
        active: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted int32 (B,), correction int32 (B,)): leading drafts equal to the target argmax
        and the argmax at the first mismatch."""
        return reference.rejection_greedy_accept_reference(cu_num_draft_tokens, draft_token_ids, target_logits, active)

    def rejection_random_accept(
        self,
        cu_num_draft_tokens: torch.Tensor,
        draft_token_ids: torch.Tensor,
        target_logits: torch.Tensor,
        temperature: torch.Tensor | None,
        draft_probs: torch.Tensor | None,
        uniform: torch.Tensor,
        active: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted int32 (B,), row_lse float32 (B,)): leading drafts with target_p / draft_p >= u
        and the logsumexp of the first rejected row."""
        return reference.rejection_random_accept_reference(
            cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, uniform, active
        )

    def rejection_recover(
        self,
        cu_num_draft_tokens: torch.Tensor,
        draft_token_ids: torch.Tensor,
        target_logits: torch.Tensor,
        temperature: torch.Tensor | None,
        draft_probs: torch.Tensor | None,
        accepted: torch.Tensor,
        row_lse: torch.Tensor,
        noise: torch.Tensor,
        active: torch.Tensor | None,
    ) -> torch.Tensor:
        """int32 (B,): the recovered token at each request's first rejected row, drawn with `noise`
        of kind `recovery_noise`."""
        needed, weights = reference.recovery_weights_reference(
            cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, accepted, row_lse, active
        )
        if self.recovery_noise == "uniform":
            return reference.rejection_recover_inverse_cdf_reference(needed, weights, noise)
        return reference.rejection_recover_exponential_reference(needed, weights, noise)
    @property
    def sampling_noise_kind(self) -> str:
        """What `draw_sampling_noise` returns: NOISE_EXPONENTIAL (B, V) or NOISE_UNIFORM (B,)."""
        return NOISE_EXPONENTIAL

    def draw_sampling_noise(
        self, batch_size: int, vocab_size: int, generators: dict[int, torch.Generator] | None
    ) -> SamplingNoise:
        """Queue the random numbers `random_sample` will consume, on the side stream and marked by an
        event, so that a call made before the model's forward pass overlaps it. Default: the
        exponential trick's q ~ Exp(1), float32 (batch_size, vocab_size); rows listed in
        `generators` draw from their own generator."""
        with self.side_stream():
            q = torch.empty((batch_size, vocab_size), dtype=torch.float32, device=self.device)
            fill_exponential(q, generators)
            event = self.record_event()
        return SamplingNoise(NOISE_EXPONENTIAL, q, event)

    def random_sample(
        self, probs: torch.Tensor, generators: dict[int, torch.Generator] | None, noise: SamplingNoise | None
    ) -> torch.Tensor:
        """int64 (B,): one exact draw per row of probs (B, V) (non-negative, any positive total).
        `noise` comes from `draw_sampling_noise` for the same shape and generators, or None to draw
        it now. Default: the exponential trick, argmax(p / q), with q from the side stream."""
        if noise is None:
            noise = self.draw_sampling_noise(probs.shape[0], probs.shape[1], generators)
        self.wait_event(noise.event)
        self.claim_on_current_stream(noise.values)
        sampled = exponential_race(probs, noise.values)
        undefined = undefined_prob_rows(probs)
        fallback = self.undefined_row_fallback(probs, undefined)
        return sampled if fallback is None else torch.where(undefined, fallback, sampled)

    def sample_from_logits(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor | None,
        k: torch.Tensor | None,
        p: torch.Tensor | None,
        max_top_k: int | None,
        generators: dict[int, torch.Generator] | None,
        noise: SamplingNoise | None,
    ) -> torch.Tensor | None:
        """int64 (B,): one draw per row from the softmax of top-p(top-k(logits / temperature))
        (float32 (B, V) logits, read not written; temperature per row, None: already tempered), a
        row without a distribution given its fallback token (sampling_rules.py); `noise` as for
        `random_sample`. None where this backend has no kernel doing it in one go for these
        arguments: the caller then filters and draws step by step. Default: None."""
        return None

    def undefined_row_fallback(self, scores: torch.Tensor, undefined: torch.Tensor) -> torch.Tensor | None:
        """int64 (B,): the fallback token of each row (meaningful where `undefined`, see
        sampling_rules.py), or None when the backend can tell for free that no row is undefined. Default:
        computed for every row, without a host sync."""
        return fallback_tokens(scores)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 (B,): torch.argmax(logits, dim=-1) (the first maximum; NaN counts as the maximum)."""
        return logits.argmax(dim=-1)

    def apply_top_k_top_p(
        self, logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None, max_top_k: int | None
    ) -> torch.Tensor:
        """In place on contiguous float32 (B, V) logits: top-k then top-p (semantics in
        sampling_rules.py); returns logits. `max_top_k`, when the caller knows it on the host, is max(k) over rows that filter
        (None: unknown, or some row has no top-k). Default: the sort-based reference."""
        return apply_top_k_top_p_reference(logits, k, p)

    def top_k_top_p_probs(
        self, logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None, max_top_k: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(filtered logits, probs): apply_top_k_top_p, then the probabilities to draw from: the
        softmax of the filtered logits, or per row any positive multiple of it (random_sample
        normalises), float32. Default: the filter, then a softmax; a backend whose filter already
        holds the softmax returns it with the removed tokens zeroed (one softmax less)."""
        filtered = self.apply_top_k_top_p(logits, k, p, max_top_k)
        return filtered, filtered.softmax(dim=-1, dtype=torch.float32)

    # ---- streams: where work that must not block the decode step is queued ----

    def side_stream(self) -> contextlib.AbstractContextManager:
        """Context in which queued work runs off the main stream (a no-op where there is none)."""
        return contextlib.nullcontext()

    def record_event(self) -> Any:
        """An event marking the work queued so far on the current stream (None where synchronous)."""
        return None

    def wait_event(self, event: Any) -> None:
        """Make the current stream wait for `event` without blocking the host."""

    def claim_on_current_stream(self, tensor: torch.Tensor) -> None:
        """Tell the caching allocator that `tensor`, made on the side stream, is used on the current
        one (so its memory is not reused too early); a no-op without streams."""

    # ---- misc ----

    def synchronize(self) -> None:
        """Block the host until queued work finished (benchmarks only; never inside a decode step)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} on {self.device}>"
