"""Data layouts shared by the backends and the layers above them: the packed token bitmask, the
rows of a CSR table (tree candidates, padded for gathers), and speculative decoding's flattened
draft layout. These are formats, not references: production code packs, gathers and lays out
with them, and the torch references (backends/reference/) are written on top of them.
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


# ---- CSR rows and the sparse candidate layout ----


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


def candidate_column_tokens(columns: torch.Tensor, starts: torch.Tensor, widths: torch.Tensor, allow_tok: torch.Tensor) -> torch.Tensor:
    """int64 (n,): the token of column columns[i] of row i of the sparse layout (a padding column
    maps to the row's last allowed token; a row with no allowed token to 0)."""
    last = max(allow_tok.shape[0] - 1, 0)
    tokens = allow_tok[(starts + torch.minimum(columns.long(), (widths - 1).clamp(min=0))).clamp(max=last)]
    return torch.where(widths > 0, tokens.long(), 0)


# ---- speculative decoding: the flattened draft layout ----
#
# Layout (vLLM's): the drafts of B requests are flattened into N = sum(num_draft_tokens) rows;
# `cu_num_draft_tokens` (B,) holds each request's END offset (an inclusive cumulative sum), so
# request r owns rows [cu[r-1], cu[r]). A draft id outside [0, V) is a placeholder and is never
# accepted.


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



def rejection_output(
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

