"""Token bitmasks in xgrammar's format: int32 (rows, ceil(V/32)); bit j of word i is token 32*i+j;
1 = allowed, 0 = the logit becomes -inf; -1 (all bits set) allows every token of the word."""
from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ..backends import Backend, backend_for_tensor
from ..backends.formats import BITS_PER_WORD, num_bitmask_words, pack_bitmask, unpack_bitmask
from ..backends.transfer import to_device
from ..checks import as_index, as_positive_int, as_token_id, is_integer

__all__ = [
    "allocate_token_bitmask",
    "apply_token_bitmask_inplace",
    "bitmask_from_token_ids",
    "fill_bitmask_row",
    "get_bitmask_shape",
    "reset_token_bitmask",
    "token_ids_from_bitmask",
    "unpack_bitmask",
    "pack_bitmask",
]

LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def get_bitmask_shape(batch_size: int, vocab_size: int) -> tuple[int, int]:
    return (batch_size, num_bitmask_words(vocab_size))


def allocate_token_bitmask(batch_size: int, vocab_size: int, device: str | torch.device | None = None) -> torch.Tensor:
    """int32 (batch_size, ceil(vocab_size/32)), every token allowed (-1)."""
    if not is_integer(batch_size) or batch_size < 0:
        raise ValueError(f"batch_size must be an integer >= 0, got {batch_size!r}")
    vocab_size = as_positive_int(vocab_size, "vocab_size")
    return torch.full(get_bitmask_shape(int(batch_size), vocab_size), -1, dtype=torch.int32, device=device)


def reset_token_bitmask(bitmask: torch.Tensor) -> None:
    """Allow every token again, in place."""
    bitmask.fill_(-1)


def _check_token_ids(token_ids: Iterable[int], vocab_size: int, row: int | None = None) -> list[int]:
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Iterable):
        raise ValueError(f"token ids{'' if row is None else f' of row {row}'} must be a list of ints, got {type(token_ids).__name__}")
    where = "" if row is None else f" in row {row}"
    return [as_token_id(t, vocab_size, where) for t in token_ids]


def _check_bitmask(bitmask: Any, vocab_size: int) -> None:
    if not isinstance(bitmask, torch.Tensor) or bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got {_describe(bitmask)}")
    words = num_bitmask_words(vocab_size)
    if bitmask.shape[1] != words:
        raise ValueError(
            f"bitmask rows have {bitmask.shape[1]} words but vocab_size {vocab_size} needs {words} "
            f"(ceil({vocab_size} / 32)); allocate it with allocate_token_bitmask(rows, {vocab_size})"
        )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def fill_bitmask_row(bitmask: torch.Tensor, row: int, token_ids: Iterable[int], vocab_size: int) -> None:
    """Make row `row` allow exactly `token_ids`. The bitmask must have ceil(vocab_size / 32) words
    per row (ValueError otherwise, never a silently broadcast word)."""
    vocab_size = as_positive_int(vocab_size, "vocab_size")
    _check_bitmask(bitmask, vocab_size)
    row = as_index(row, "row", bitmask.shape[0])
    ids = _check_token_ids(token_ids, vocab_size, row)
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    allowed[ids] = True
    bitmask[row] = pack_bitmask(allowed).to(bitmask.device)


def bitmask_from_token_ids(
    rows: Sequence[Iterable[int]], vocab_size: int, device: str | torch.device | None = None
) -> torch.Tensor:
    """One bitmask row per entry of `rows`, allowing exactly the listed token ids."""
    vocab_size = as_positive_int(vocab_size, "vocab_size")
    allowed = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
    for r, token_ids in enumerate(rows):
        allowed[r, _check_token_ids(token_ids, vocab_size, r)] = True
    return pack_bitmask(allowed).to(device)


def token_ids_from_bitmask(bitmask: torch.Tensor, vocab_size: int) -> list[list[int]]:
    """The allowed token ids of each row, sorted (a 1-D bitmask is one row)."""
    vocab_size = as_positive_int(vocab_size, "vocab_size")
    if not isinstance(bitmask, torch.Tensor) or bitmask.dtype != torch.int32 or bitmask.dim() not in (1, 2):
        raise ValueError(f"bitmask must be a 1-D or 2-D int32 tensor, got {_describe(bitmask)}")
    rows = bitmask.reshape(-1, bitmask.shape[-1]).cpu()
    # Only the non-zero words are unpacked: a constrained row often allows a handful of tokens.
    pairs = (rows != 0).nonzero()  # (row, word), row-major
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32)
    bits = ((rows[pairs[:, 0], pairs[:, 1]].unsqueeze(1) >> shifts) & 1).nonzero()  # (pair, bit)
    ids = pairs[bits[:, 0], 1] * BITS_PER_WORD + bits[:, 1]
    row_of = pairs[bits[:, 0], 0]
    keep = ids < vocab_size
    ids, row_of = ids[keep], row_of[keep]
    return [part.tolist() for part in ids.split(torch.bincount(row_of, minlength=rows.shape[0]).tolist())]


def _rows_tensor(indices, limit: int, device: torch.device) -> torch.Tensor:
    if isinstance(indices, torch.Tensor):
        if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 1:
            raise ValueError(f"indices must be a 1-D int32/int64 tensor, got {indices.dtype} with shape {tuple(indices.shape)}")
        rows = indices.to(device=device, dtype=torch.int64)
        if rows.numel():
            # One host sync for device tensors; pass a list or CPU tensor to avoid it.
            lo, hi = int(rows.min()), int(rows.max())
            if lo < 0 or hi >= limit:
                bad = lo if lo < 0 else hi
                raise ValueError(f"indices contains row {bad}, outside [0, {limit})")
        return rows
    ids = [as_index(i, "indices row", limit) for i in indices]
    # Through numpy: torch.tensor(list) costs ~2.5 us, this ~1 us.
    return to_device(torch.from_numpy(np.array(ids, dtype=np.int64)), device)


def apply_token_bitmask_inplace(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    *,
    indices: Sequence[int] | torch.Tensor | None = None,
    vocab_size: int | None = None,
    backend: str | torch.device | Backend | None = None,
) -> None:
    """Set logits to -inf where the bitmask disallows the token, in place; xgrammar's semantics.

    logits: float32/float16/bfloat16 (B, V) or (V,); bitmask: int32 (B', W) or (W,) on the same device.
    indices: rows to mask (of both tensors); None = all rows, then B == B'.
    vocab_size: tokens to consider; default min(V, 32 * W).
    """
    # Called once per decode step: read shapes and strides once, and build the 2-D views only
    # after every check passed (each torch attribute access costs ~0.1-1 us on CPU).
    if not isinstance(logits, torch.Tensor) or not isinstance(bitmask, torch.Tensor):
        raise ValueError("logits and bitmask must be torch tensors")
    if logits.dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits dtype must be float32, float16 or bfloat16, got {logits.dtype}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask dtype must be int32, got {bitmask.dtype}")
    logits_shape, bitmask_shape = logits.shape, bitmask.shape
    logits_dim, bitmask_dim = len(logits_shape), len(bitmask_shape)
    if logits_dim not in (1, 2) or bitmask_dim not in (1, 2):
        raise ValueError(f"logits and bitmask must be 1-D or 2-D, got shapes {tuple(logits_shape)} and {tuple(bitmask_shape)}")
    if logits.device != bitmask.device:
        raise ValueError(f"logits are on {logits.device} but the bitmask is on {bitmask.device}; move the bitmask first")
    width, words = logits_shape[-1], bitmask_shape[-1]
    if width and logits.stride()[-1] != 1 or words and bitmask.stride()[-1] != 1:
        raise ValueError("logits and bitmask must be contiguous in their last dimension")
    covered = min(width, words * 32)
    if vocab_size is None:
        if words * 32 < width:
            warnings.warn(
                f"the bitmask covers only {words * 32} tokens but logits have {width}; "
                "the trailing logits are left unmasked (pass vocab_size or allocate the full vocabulary)",
                stacklevel=2,
            )
        vocab_size = covered
    elif not is_integer(vocab_size) or not 0 < vocab_size <= covered:
        raise ValueError(f"vocab_size {vocab_size!r} must be an integer in (0, {covered}] (min of logits width and 32 * bitmask words)")
    logits_rows = logits_shape[0] if logits_dim == 2 else 1
    bitmask_rows = bitmask_shape[0] if bitmask_dim == 2 else 1
    if indices is None:
        if logits_rows != bitmask_rows:
            raise ValueError(
                f"logits have {logits_rows} rows but the bitmask has {bitmask_rows}; pass indices to mask a subset"
            )
        rows = None
    else:
        rows = _rows_tensor(indices, min(logits_rows, bitmask_rows), logits.device)
        if rows.numel() == 0:
            return
    if vocab_size == 0 or logits_rows == 0:
        return
    chosen = backend_for_tensor(logits, backend)
    chosen.apply_token_bitmask(
        logits if logits_dim == 2 else logits.unsqueeze(0),
        bitmask if bitmask_dim == 2 else bitmask.unsqueeze(0),
        rows,
        vocab_size,
    )
