"""The one torch reference for every kernel logitgate ships.

Each backend's kernel is tested against the functions here on random inputs. They favour clarity
over speed and run on any device torch supports.
"""
from __future__ import annotations

import torch

BITS_PER_WORD = 32


def num_bitmask_words(vocab_size: int) -> int:
    """Words per bitmask row: ceil(vocab_size / 32)."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 (..., W) bitmask -> bool (..., vocab_size); True where the token is allowed."""
    shifts = torch.arange(BITS_PER_WORD, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool (..., V) -> int32 (..., ceil(V/32)); the inverse of unpack_bitmask."""
    vocab_size = allowed.shape[-1]
    words = num_bitmask_words(vocab_size)
    padded = torch.zeros(*allowed.shape[:-1], words * BITS_PER_WORD, dtype=torch.int64, device=allowed.device)
    padded[..., :vocab_size] = allowed.to(torch.int64)
    weights = torch.ones(BITS_PER_WORD, dtype=torch.int64, device=allowed.device) << torch.arange(
        BITS_PER_WORD, device=allowed.device
    )
    packed = (padded.view(*allowed.shape[:-1], words, BITS_PER_WORD) * weights).sum(-1)
    # Values >= 2**31 wrap to the negative int32 with the same bits (bit 31 set).
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def apply_token_bitmask_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None, vocab_size: int
) -> None:
    """Set logits[r, t] = -inf for every selected row r and token t < vocab_size whose bit is 0.

    logits (N, V') and bitmask (M, W) are 2-D; `rows` selects rows of both (xgrammar's `indices`),
    None means every row (then N == M).
    """
    selected_logits = logits if rows is None else logits[rows]
    selected_mask = bitmask if rows is None else bitmask[rows]
    allowed = unpack_bitmask(selected_mask, vocab_size)
    masked = selected_logits[:, :vocab_size].masked_fill(~allowed, float("-inf"))
    if rows is None:
        logits[:, :vocab_size] = masked
    else:
        logits[rows, :vocab_size] = masked


def gather_csr_rows(
    states: torch.Tensor, starts: torch.Tensor, widths: torch.Tensor, values: torch.Tensor, max_width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a CSR table, padded: out[r, k] = values[starts[s] + k] for k < widths[s], s = states[r].

    Returns (out (B, max_width), valid (B, max_width) bool). Padding repeats the row's first entry, so
    the ids stay usable as gather indices; every state must have starts[s] < len(values).
    """
    offs = torch.arange(max_width, device=states.device)
    first = starts[states].unsqueeze(1)
    valid = offs < widths[states].unsqueeze(1)
    return values[torch.where(valid, first + offs, first)], valid


def candidate_tokens(starts: torch.Tensor, widths: torch.Tensor, allow_tok: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 (n, width), valid bool (n, width)): tokens[i, j] = allow_tok[starts[i] + j] for
    j < widths[i], else the row's first candidate (0 for an empty row), so the ids stay usable as
    gather indices. allow_tok is read only below each row's width: a table may pad its rows (e.g.
    with -1) and an empty row's start may point anywhere, its end included."""
    offs = torch.arange(width, device=allow_tok.device)
    valid = offs < widths.unsqueeze(1)
    index = torch.where(valid, starts.unsqueeze(1) + offs, 0)
    tokens = allow_tok[index].long() if allow_tok.numel() else torch.zeros_like(index)
    tokens = torch.where(valid, tokens, 0)
    return torch.where(valid, tokens, tokens[:, :1]), valid


def gather_candidate_logits_reference(
    logits: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    widths: torch.Tensor,
    allow_tok: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """float32 (n, width): out[i, j] = logits[rows[i], allow_tok[starts[i] + j]] for j < widths[i],
    -inf after (the sparse sampling layout of tree candidates; column j of row i stands for token
    allow_tok[starts[i] + j]). Every widths[i] must be <= width."""
    tokens, valid = candidate_tokens(starts, widths, allow_tok, width)
    values = logits[rows.unsqueeze(1), tokens].float()
    return values.masked_fill_(~valid, float("-inf"))


def candidate_argmax_reference(
    logits: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    widths: torch.Tensor,
    allow_tok: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """int64 (n,): the greedy token of each row of the sparse layout, i.e. the token of the argmax
    column of gather_candidate_logits_reference (the first maximum, NaN counting as the maximum,
    as torch.argmax): allowed tokens are sorted, so ties go to the smallest token id, as in the
    dense argmax of the masked row. A row with no allowed token gives 0 (the dense argmax of an
    all -inf row)."""
    if width == 0:
        return torch.zeros(rows.shape[0], dtype=torch.int64, device=logits.device)
    columns = gather_candidate_logits_reference(logits, rows, starts, widths, allow_tok, width).argmax(dim=-1)
    return candidate_column_tokens(columns, starts, widths, allow_tok)


def candidate_column_tokens(columns: torch.Tensor, starts: torch.Tensor, widths: torch.Tensor, allow_tok: torch.Tensor) -> torch.Tensor:
    """int64 (n,): the token of column columns[i] of row i of the sparse layout (a padding column
    maps to the row's last allowed token; a row with no allowed token to 0)."""
    last = max(allow_tok.shape[0] - 1, 0)
    tokens = allow_tok[(starts + torch.minimum(columns.long(), (widths - 1).clamp(min=0))).clamp(max=last)]
    return torch.where(widths > 0, tokens.long(), 0)


def sample_candidates_reference(
    logits: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    widths: torch.Tensor,
    allow_tok: torch.Tensor,
    width: int,
    temperature: torch.Tensor,
    greedy: torch.Tensor | None,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """int64 (n,): one token per row of the sparse layout (gather_candidate_logits_reference), drawn
    as the Sampler draws from that layout on a backend with uniform noise: greedy rows
    (greedy[i]; None: none) take candidate_argmax_reference's token; the others divide by
    temperature[i] (float32), then top-k (top_k[i]; 0 / >= width keep the row) and top-p (top_p[i];
    1 keeps it) as apply_top_k_top_p_reference, then the inverse-CDF draw with uniform[i]
    (float64 in [0, 1), inverse_cdf_sample_reference) over the softmax; a row of the tempered
    layout with a NaN, a +inf or nothing above -inf gives the token of its fallback column
    (fallback_tokens). Tokens outside a row's candidates have probability 0, so this is the draw
    from the masked full row. A row with no candidate gives 0. Per-row tensors have n entries."""
    n = rows.shape[0]
    if width == 0 or n == 0:
        return torch.zeros(n, dtype=torch.int64, device=logits.device)
    values = gather_candidate_logits_reference(logits, rows, starts, widths, allow_tok, width)
    greedy_columns = values.argmax(dim=-1)
    scale = temperature.to(torch.float32) if greedy is None else torch.where(greedy, 1.0, temperature.to(torch.float32))
    tempered = values.div_(scale.unsqueeze(1))
    undefined = undefined_logit_rows(tempered)
    fallback = fallback_tokens(tempered)
    apply_top_k_top_p_reference(tempered, top_k, top_p)
    columns = inverse_cdf_sample_reference(tempered.softmax(dim=-1), uniform)
    columns = torch.where(undefined, fallback, columns)
    if greedy is not None:
        columns = torch.where(greedy, greedy_columns, columns)
    return candidate_column_tokens(columns, starts, widths, allow_tok)


def keep_candidate_logits_reference(
    logits: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    widths: torch.Tensor,
    allow_tok: torch.Tensor,
    width: int,
) -> None:
    """In place: every logit of row rows[i] becomes -inf except the tokens
    allow_tok[starts[i] : starts[i] + widths[i]] (the dense masking of tree candidates without a
    bitmask: fill the row, scatter the allowed logits back); a row with widths[i] = 0 becomes all
    -inf. Every widths[i] must be <= width; rows must be distinct."""
    if rows.numel() == 0:
        return
    tokens, _ = candidate_tokens(starts, widths, allow_tok, width)
    kept = logits[rows.unsqueeze(1), tokens].masked_fill_((widths == 0).unsqueeze(1), float("-inf"))
    logits[rows] = float("-inf")
    # Padding repeats a row's first candidate with its own value (an empty row's column 0 with -inf),
    # so duplicate writes agree and no host-side count of the valid entries is needed.
    logits[rows.unsqueeze(1), tokens] = kept


def fill_tree_bitmask_reference(
    bitmask: torch.Tensor,
    states: torch.Tensor,
    allow_start: torch.Tensor,
    allow_tok: torch.Tensor,
    fill_width: torch.Tensor,
    max_width: int,
    dense_rows: torch.Tensor | None = None,
    dense_slot: torch.Tensor | None = None,
) -> None:
    """bitmask[r] (int32 (B, W), contiguous) := the allowed set of tree state s = states[r]: the
    precomputed row dense_rows[dense_slot[s]] (row 0 is all zero; the rows may cover fewer words than
    W, the rest is zeroed) plus the bits of allow_tok[allow_start[s] : allow_start[s] + fill_width[s]]
    (nothing past a state's fill width is read). A state has either a dense row or a sparse list
    (fill_width 0), and its tokens are distinct, so adding the bits equals OR-ing them."""
    rows, words = bitmask.shape
    if dense_rows is None:
        bitmask.zero_()
    elif dense_rows.shape[1] == words:
        torch.index_select(dense_rows, 0, dense_slot[states], out=bitmask)
    else:
        bitmask[:, : dense_rows.shape[1]] = dense_rows[dense_slot[states]]
        bitmask[:, dense_rows.shape[1] :] = 0
    if max_width == 0 or rows == 0:
        return
    tok, valid = candidate_tokens(allow_start[states], fill_width[states], allow_tok, max_width)
    bits = torch.where(valid, torch.ones_like(tok) << (tok & (BITS_PER_WORD - 1)), 0)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)  # bit 31 -> negative int32
    index = torch.arange(rows, device=bitmask.device).unsqueeze(1) * words + (tok >> 5)
    bitmask.view(-1).scatter_add_(0, index.reshape(-1), bits.reshape(-1))

# ---- speculative decoding: rejection sampling ----
#
# Layout (vLLM's): the drafts of B requests are flattened into N = sum(num_draft_tokens) rows;
# `cu_num_draft_tokens` (B,) holds each request's END offset (an inclusive cumulative sum), so
# request r owns rows [cu[r-1], cu[r]). A draft id outside [0, V) is a placeholder and is never
# accepted. Every kernel below returns defined values (0) for inactive requests and for requests
# that accepted all their drafts, so backends can be compared exactly.


def spec_layout(cu_num_draft_tokens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(starts (B,), counts (B,), request of each token (N,)) as int64 on the device of `cu`."""
    ends = cu_num_draft_tokens.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]]) if ends.numel() else ends
    tokens = torch.arange(num_tokens, device=ends.device)
    token_request = torch.searchsorted(ends, tokens, right=True)
    return starts, ends - starts, token_request


def leading_true_counts(flags: torch.Tensor, cu_num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """For each request, how many of its leading tokens have flags True (int32 (B,)); no host sync."""
    starts, counts, token_request = spec_layout(cu_num_draft_tokens, flags.numel())
    positions = torch.arange(flags.numel(), device=flags.device) - starts[token_request]
    first_false = torch.where(flags, counts[token_request], positions)
    return counts.scatter_reduce(0, token_request, first_false, reduce="amin").to(torch.int32)


def tempered_logits(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """float32 logits / temperature (per row); vLLM divides in float32 too."""
    logits = logits.float()
    return logits if temperature is None else logits / temperature.to(torch.float32).unsqueeze(-1)


def _rows_at(cu_num_draft_tokens: torch.Tensor, accepted: torch.Tensor, num_tokens: int):
    """Row of each request's first rejected draft (clamped into range) and whether there is one."""
    starts, counts, _ = spec_layout(cu_num_draft_tokens, num_tokens)
    rejected = accepted.to(torch.int64) < counts
    rows = (starts + accepted.to(torch.int64)).clamp(0, max(num_tokens - 1, 0))
    return rows, rejected


def _at_first_rejection(cu_num_draft_tokens, accepted, per_row, active, num_tokens):
    """(accepted, per_row at each request's first rejected row) with 0 for requests that accepted
    everything or are inactive."""
    rows, rejected = _rows_at(cu_num_draft_tokens, accepted, num_tokens)
    keep = rejected if active is None else rejected & active
    zero = torch.zeros((), dtype=per_row.dtype, device=per_row.device)
    value = torch.where(keep, per_row[rows], zero) if num_tokens else zero.expand(accepted.shape)
    if active is not None:
        accepted = torch.where(active, accepted, 0)
    return accepted.to(torch.int32), value


def rejection_greedy_accept_reference(
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    active: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: (accepted int32 (B,), correction int32 (B,)).

    accepted = leading drafts equal to the target argmax (torch.argmax semantics: first maximum,
    a NaN counts as the maximum); correction = the argmax at the first mismatch, 0 when every draft
    matched or the request is inactive (active False)."""
    argmax = target_logits.float().argmax(-1)
    accepted = leading_true_counts(draft_token_ids.to(torch.int64) == argmax, cu_num_draft_tokens)
    accepted, correction = _at_first_rejection(cu_num_draft_tokens, accepted, argmax, active, argmax.numel())
    return accepted, correction.to(torch.int32)


def rejection_random_accept_reference(
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    draft_probs: torch.Tensor | None,
    uniform: torch.Tensor,
    active: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random verification: (accepted int32 (B,), row_lse float32 (B,)).

    Draft x at row i is accepted while x is in [0, V), draft_p > 0, target_p > 0 and
    target_p / draft_p >= uniform[i], where target_p = softmax(logits_i / T_i)[x] and draft_p =
    draft_probs[i, x] (1 without draft probs: an n-gram draft is a point mass). A row without a
    distribution (its logsumexp is not finite: a NaN, a +inf, all -inf) is a point mass on its
    fallback token (target_p 1 there, 0 elsewhere). row_lse is the logsumexp of the tempered logits
    at the first rejected row (0 when none / inactive), which `rejection_recover` needs to
    normalise that row without another pass."""
    num_tokens, vocab = target_logits.shape
    z = tempered_logits(target_logits, temperature)
    lse = z.logsumexp(-1)
    ids = draft_token_ids.to(torch.int64)
    valid = (ids >= 0) & (ids < vocab)
    safe = ids.clamp(0, vocab - 1).unsqueeze(-1)
    target_p = (z.gather(-1, safe).squeeze(-1) - lse).exp().double()
    target_p = torch.where(torch.isfinite(lse), target_p, (ids == fallback_tokens(z)).double())
    draft_p = torch.ones_like(target_p) if draft_probs is None else draft_probs.gather(-1, safe).squeeze(-1).double()
    ok = valid & (draft_p > 0) & (target_p > 0) & (target_p / draft_p >= uniform)
    accepted = leading_true_counts(ok, cu_num_draft_tokens)
    accepted, row_lse = _at_first_rejection(cu_num_draft_tokens, accepted, lse, active, num_tokens)
    return accepted, row_lse.to(torch.float32)


def recovery_weights_reference(
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    draft_probs: torch.Tensor | None,
    accepted: torch.Tensor,
    row_lse: torch.Tensor,
    active: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(needed bool (B,), weights float32 (B, V)): the unnormalised distribution of the recovered
    token at each request's first rejected row.

    weights = max(target - draft, 0) with draft probs; the target without the draft token for an
    n-gram draft; the target itself for a placeholder (there was no draft to correct). NaN counts as
    0. When nothing is left (target == draft) the target is used. A row without a distribution
    (row_lse not finite) weighs only its fallback token."""
    num_tokens, vocab = target_logits.shape
    rows, needed = _rows_at(cu_num_draft_tokens, accepted, num_tokens)
    if active is not None:
        needed = needed & active
    if num_tokens == 0:
        return needed, torch.zeros(needed.numel(), vocab, device=target_logits.device)
    z = tempered_logits(target_logits[rows], None if temperature is None else temperature[rows])
    target = (z - row_lse.unsqueeze(-1)).exp()
    target = torch.where(target > 0, target, 0.0)
    ids = draft_token_ids.to(torch.int64)[rows]
    valid = ((ids >= 0) & (ids < vocab)).unsqueeze(-1)
    if draft_probs is None:
        drafted = torch.arange(vocab, device=target.device) == ids.unsqueeze(-1)
        residual = target.masked_fill(drafted, 0.0)
    else:
        residual = target - draft_probs[rows].float()
    residual = torch.where(valid & (residual > 0), residual, torch.where(valid, 0.0, target))
    empty = ~(residual.sum(-1, keepdim=True) > 0)
    weights = torch.where(empty, target, residual)
    point = torch.arange(vocab, device=z.device) == fallback_tokens(z).unsqueeze(-1)
    return needed, torch.where(torch.isfinite(row_lse).unsqueeze(-1), weights, point.to(weights.dtype))


def rejection_recover_inverse_cdf_reference(needed: torch.Tensor, weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw, one float64 uniform per request: the first token whose cumulative weight
    (float64) exceeds uniform * total; int32 (B,), 0 where not needed or all weights are 0."""
    if weights.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int32, device=weights.device)
    cum = weights.double().cumsum(-1)
    total = cum[:, -1]
    token = torch.searchsorted(cum, (uniform * total).unsqueeze(-1), right=True).squeeze(-1)
    vocab = weights.shape[-1]
    last_positive = vocab - 1 - (weights > 0).flip(-1).to(torch.int8).argmax(-1)
    token = torch.where(token >= vocab, last_positive, token)  # uniform * total rounded up to total
    return torch.where(needed & (total > 0), token, 0).to(torch.int32)


def rejection_recover_exponential_reference(needed: torch.Tensor, weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race argmax(w / q), q ~ Exp(1) per (request, token), float32 like vLLM;
    zero-weight tokens never win. int32 (B,), 0 where not needed or all weights are 0."""
    if weights.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int32, device=weights.device)
    score = torch.where(weights > 0, weights / noise, -1.0)
    return torch.where(needed, score.argmax(-1), 0).to(torch.int32)


def rejection_output_reference(
    starts: torch.Tensor,
    draft_token_ids: torch.Tensor,
    accepted: torch.Tensor,
    final_token: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """int32 (B, width): the accepted drafts (request r's start at starts[r]), then final_token
    (the correction, or the bonus when every draft was accepted), then -1."""
    positions = torch.arange(width, device=accepted.device).unsqueeze(0)
    accepted = accepted.to(torch.int64).unsqueeze(-1)
    out = torch.full((accepted.shape[0], width), -1, dtype=torch.int32, device=accepted.device)
    if draft_token_ids.numel():
        index = (starts.unsqueeze(-1) + positions).clamp(max=draft_token_ids.numel() - 1)
        out = torch.where(positions < accepted, draft_token_ids.to(torch.int32)[index], out)
    return torch.where(positions == accepted, final_token.to(torch.int32).unsqueeze(-1), out)
# ---- sampling ----------------------------------------------------------------------------------
#
# Top-k / top-p semantics (shared by every backend):
# - top-k keeps every token whose logit is >= the k-th largest logit of its row (ties at the k-th
#   value are all kept, as in vLLM); k <= 0 or k >= V leaves the row alone.
# - top-p keeps every token whose probability mass strictly above it, sum(p_j for p_j > p_i), is
#   < top_p, where p = softmax of the (top-k filtered) logits; the most likely token is always kept,
#   tied tokens are kept or removed together, and top_p >= 1 (or NaN) leaves the row alone. The
#   public functions reject top_p <= 0 where they can see it without a host sync; a device tensor
#   that slips through behaves as the smallest positive top_p (only the most likely tokens stay).
#
# Rows without a distribution (shared by every backend): a random row whose logits hold a NaN or a
# +inf, or no value above -inf, has no defined softmax. Such a row is sampled as a point mass on its
# fallback token: the argmax of the row with NaN ignored (a +inf wins; first of ties), token 0 when
# every value is NaN or -inf. The same holds for a probability row whose total is not a finite
# positive number, and for rejection sampling's target rows (a draft is accepted exactly when it is
# the fallback token, which is also the recovered token). Greedy rows keep torch.argmax (vLLM's: a
# NaN counts as the maximum).


def undefined_logit_rows(logits: torch.Tensor, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """bool (B,): rows of logits / temperature with no defined softmax (a NaN, a +inf, or nothing
    above -inf); one reduction, no host sync. The peak divided by the temperature is the peak of the
    tempered row (division by a positive number is monotonic), so no tempered copy is needed."""
    peak = logits.amax(dim=-1).to(torch.float32)
    if temperature is not None:
        peak = peak / temperature.to(torch.float32)
    return ~torch.isfinite(peak)


def undefined_prob_rows(probs: torch.Tensor) -> torch.Tensor:
    """bool (B,): probability rows whose total is not a finite positive number (a NaN, an inf, all 0)."""
    total = probs.sum(dim=-1, dtype=torch.float32)
    return ~(torch.isfinite(total) & (total > 0))


def fallback_tokens(scores: torch.Tensor) -> torch.Tensor:
    """int64 (B,): each row's argmax with NaN ignored (first of ties), 0 for a row of NaN / -inf."""
    return scores.masked_fill(torch.isnan(scores), float("-inf")).argmax(dim=-1)


def top_k_disabled(k: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Rows whose top-k value does not filter: k <= 0 or k >= V."""
    return (k <= 0) | (k >= vocab_size)


def apply_top_k_top_p_reference(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Sort-based top-k then top-p, in place on 2-D float logits (rows filtered by -inf); returns logits.

    k: int (B,) or None; p: float (B,) or None. Top-p sees the softmax of the top-k filtered row.
    """
    if k is None and p is None:
        return logits
    vocab_size = logits.shape[-1]
    if k is not None:
        sorted_logits = logits.sort(dim=-1, descending=True).values
        k_index = k.to(torch.int64).clamp(1, vocab_size).sub(1).unsqueeze(1)
        kth = sorted_logits.gather(1, k_index)
        kth.masked_fill_(top_k_disabled(k, vocab_size).unsqueeze(1), float("-inf"))
        logits.masked_fill_(logits < kth, float("-inf"))
    if p is not None:
        probs = logits.softmax(dim=-1)
        threshold = top_p_threshold(probs.sort(dim=-1, descending=True).values, p)
        logits.masked_fill_(probs < threshold, float("-inf"))
    return logits


def top_p_threshold(sorted_probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """(B, 1): the smallest probability top-p keeps, from each row's probabilities sorted in
    descending order (a row may hold only its largest probabilities, as long as every probability
    above the cut is there); 0 for rows with p >= 1."""
    # Mass strictly above each sorted position, accumulated in float64 so that the cut does not
    # depend on float32 rounding of long cumulative sums.
    sorted64 = sorted_probs.to(torch.float64)
    mass_above = sorted64.cumsum(dim=-1) - sorted64
    # Tied probabilities share the mass above the first of them.
    first_of_tie = torch.ones_like(sorted_probs, dtype=torch.bool)
    first_of_tie[:, 1:] = sorted_probs[:, 1:] != sorted_probs[:, :-1]
    positions = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)
    group_start = torch.where(first_of_tie, positions, 0).cummax(dim=-1).values
    keep = mass_above.gather(1, group_start) < p.to(torch.float64).unsqueeze(1)
    # keep is a prefix of the sorted row; the top token (mass above it is 0) stays even when
    # p <= 0 or the row is NaN (then nothing compares below p).
    threshold = sorted_probs.gather(1, keep.sum(dim=-1, keepdim=True).clamp_(min=1) - 1)
    return threshold.masked_fill_(((p >= 1) | torch.isnan(p)).unsqueeze(1), 0.0)


def exponential_race(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The exponential trick: argmax(p / q) per row, q ~ Exp(1) i.i.d., is an exact draw from p
    (it is the first arrival of independent Poisson processes with rates p). int64 (B,)."""
    return probs.div(q).argmax(dim=-1)


def inverse_cdf_sample_reference(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: the first token whose cumulative probability exceeds u * total, with one
    uniform u in [0, 1) per row (float64); zero-probability tokens are never chosen; a row whose
    total is not a finite positive number gives its fallback token. int64 (B,)."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1]
    target = (u.to(torch.float64) * total).unsqueeze(1)
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    index = index.clamp_(max=probs.shape[-1] - 1)
    undefined = ~(torch.isfinite(total) & (total > 0))
    return torch.where(undefined, fallback_tokens(probs), index)


def fill_exponential(q: torch.Tensor, generators: dict[int, torch.Generator] | None) -> torch.Tensor:
    """q ~ Exp(1) in place; rows listed in `generators` draw from their own generator (reproducible),
    the others from the device's default generator. Values are clamped away from 0 so p / q is never
    0 / 0 (a NaN that argmax would pick)."""
    generators = generators or {}
    if len(generators) != q.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return q.clamp_(min=torch.finfo(q.dtype).tiny)


def draw_uniforms(batch_size: int, generators: dict[int, torch.Generator] | None, device: torch.device) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row; rows in `generators` draw from their own generator."""
    generators = generators or {}
    u = torch.rand(batch_size, dtype=torch.float64, device=device) if len(generators) != batch_size else (
        torch.empty(batch_size, dtype=torch.float64, device=device)
    )
    for row, generator in generators.items():
        u[row : row + 1].uniform_(generator=generator)
    return u


def random_sample_reference(probs: torch.Tensor, generators: dict[int, torch.Generator] | None = None) -> torch.Tensor:
    """An exact draw per row (the exponential trick with noise drawn now); a row without a
    distribution gives its fallback token. int64 (B,)."""
    q = fill_exponential(torch.empty(probs.shape, dtype=torch.float32, device=probs.device), generators)
    return torch.where(undefined_prob_rows(probs), fallback_tokens(probs), exponential_race(probs, q))
