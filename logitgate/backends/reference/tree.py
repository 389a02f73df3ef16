"""The torch references of the tree kernels: the sparse candidate layout (gather, greedy token, draw,
dense keep) and the tree bitmask fill.
"""
from __future__ import annotations

import torch

from ..formats import BITS_PER_WORD, candidate_column_tokens, candidate_tokens
from ..sampling_rules import fallback_tokens, undefined_logit_rows
from .sampling import apply_top_k_top_p_reference, inverse_cdf_sample_reference


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

