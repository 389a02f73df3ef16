"""Triton kernels for tree candidates, shared by CUDA and Ascend (triton-ascend).

- gather: row i of an (n, width) float32 block holds logits[rows[i]] at its allowed tokens, then
  -inf (the sparse sampling layout);
- keep: rows[i] of the logits keeps only its allowed tokens, every other column -inf;
- fill: the xgrammar-format bitmask of tree states (a precomputed dense row, plus the bits of a
  sparse token list).

Semantics: ../reference.py (gather_candidate_logits_reference, keep_candidate_logits_reference,
fill_tree_bitmask_reference). Each kernel walks (row, tile) work items with a grid-stride loop: one
tile per program on CUDA, a few long-lived programs, one per vector core, on Ascend. A row's
token list is read only below its width (an empty row, or padding after it, is never read), so
the work follows the candidates, except where the contract writes whole rows (keep's -inf, the
bitmask's words). Keep moves values as bits through an integer view (exact for every float dtype,
no arithmetic the interpreter lacks for bfloat16); in-row order between its three steps (save the
allowed values, fill the row, put them back) comes from three launches on one stream, not from
barriers inside a program. Nothing here synchronises with the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..cpu.bitmask_kernels import INT_VIEW, NEG_INF_BITS

# Bytes one lane of a tile holds (column and token indices, the value, predicates): sizes Ascend
# tiles for the 192 KB unified buffer (launch.ascend_vocab_tile).
CANDIDATE_BYTES_PER_TOKEN = 8 + 8 + 4 + 2
FILL_ROW_BYTES_PER_TOKEN = 8 + 4 + 1
BITMASK_BYTES_PER_WORD = 8 + 4 + 4 + 1


@triton.jit
def _candidates(rows_ptr, starts_ptr, widths_ptr, allow_tok_ptr, work, tiles_per_row, BLOCK: tl.constexpr):
    """Work item `work`: (its row of the layout i, the logits row, columns, which columns are
    candidates, their token ids); tokens of non-candidate columns are 0 and never used."""
    i = work // tiles_per_row
    cols = (work % tiles_per_row) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + i).to(tl.int64)
    start = tl.load(starts_ptr + i).to(tl.int64)
    valid = cols < tl.load(widths_ptr + i)
    tok = tl.load(allow_tok_ptr + start + cols, mask=valid, other=0).to(tl.int64)
    return i, row, cols, valid, tok


@triton.jit
def _gather_candidates_kernel(
    logits_ptr, rows_ptr, starts_ptr, widths_ptr, allow_tok_ptr, out_ptr,
    num_rows, width, row_stride, col_stride,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_per_row = tl.cdiv(width, BLOCK)
    for work in tl.range(pid, num_rows * tiles_per_row, tl.num_programs(0)):
        i, row, cols, valid, tok = _candidates(rows_ptr, starts_ptr, widths_ptr, allow_tok_ptr, work, tiles_per_row, BLOCK)
        value = tl.load(logits_ptr + row * row_stride + tok * col_stride, mask=valid, other=0.0).to(tl.float32)
        value = tl.where(valid, value, float("-inf"))
        tl.store(out_ptr + i.to(tl.int64) * width + cols, value, mask=cols < width)


@triton.jit
def _save_candidates_kernel(
    bits_ptr, rows_ptr, starts_ptr, widths_ptr, allow_tok_ptr, saved_ptr,
    num_rows, width, row_stride, col_stride,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_per_row = tl.cdiv(width, BLOCK)
    for work in tl.range(pid, num_rows * tiles_per_row, tl.num_programs(0)):
        i, row, cols, valid, tok = _candidates(rows_ptr, starts_ptr, widths_ptr, allow_tok_ptr, work, tiles_per_row, BLOCK)
        bits = tl.load(bits_ptr + row * row_stride + tok * col_stride, mask=valid, other=0)
        tl.store(saved_ptr + i.to(tl.int64) * width + cols, bits, mask=valid)


@triton.jit
def _restore_candidates_kernel(
    bits_ptr, rows_ptr, starts_ptr, widths_ptr, allow_tok_ptr, saved_ptr,
    num_rows, width, row_stride, col_stride,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_per_row = tl.cdiv(width, BLOCK)
    for work in tl.range(pid, num_rows * tiles_per_row, tl.num_programs(0)):
        i, row, cols, valid, tok = _candidates(rows_ptr, starts_ptr, widths_ptr, allow_tok_ptr, work, tiles_per_row, BLOCK)
        bits = tl.load(saved_ptr + i.to(tl.int64) * width + cols, mask=valid, other=0)
        tl.store(bits_ptr + row * row_stride + tok * col_stride, bits, mask=valid)


@triton.jit
def _fill_rows_kernel(bits_ptr, rows_ptr, num_rows, vocab_size, row_stride, col_stride, neg_inf_bits, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    tiles_per_row = tl.cdiv(vocab_size, BLOCK)
    for work in tl.range(pid, num_rows * tiles_per_row, tl.num_programs(0)):
        row = tl.load(rows_ptr + work // tiles_per_row).to(tl.int64)
        cols = (work % tiles_per_row) * BLOCK + tl.arange(0, BLOCK)
        tl.store(bits_ptr + row * row_stride + cols.to(tl.int64) * col_stride, neg_inf_bits, mask=cols < vocab_size)


@triton.jit
def _bitmask_dense_kernel(
    bitmask_ptr, states_ptr, dense_rows_ptr, dense_slot_ptr,
    num_rows, words, dense_words, bitmask_stride, dense_stride,
    HAS_DENSE: tl.constexpr, BLOCK: tl.constexpr,
):
    """bitmask[r] := the state's precomputed dense row (zero past its words; all zero without
    dense rows)."""
    pid = tl.program_id(0)
    tiles_per_row = tl.cdiv(words, BLOCK)
    for work in tl.range(pid, num_rows * tiles_per_row, tl.num_programs(0)):
        r = (work // tiles_per_row).to(tl.int64)
        w = (work % tiles_per_row) * BLOCK + tl.arange(0, BLOCK)
        if HAS_DENSE:
            slot = tl.load(dense_slot_ptr + tl.load(states_ptr + r)).to(tl.int64)
            value = tl.load(dense_rows_ptr + slot * dense_stride + w, mask=w < dense_words, other=0)
        else:
            value = tl.zeros((BLOCK,), tl.int32)
        tl.store(bitmask_ptr + r * bitmask_stride + w, value, mask=w < words)


@triton.jit
def _bitmask_sparse_kernel(
    bitmask_ptr, states_ptr, allow_start_ptr, allow_tok_ptr, fill_width_ptr,
    num_rows, max_width, bitmask_stride,
    BLOCK: tl.constexpr,
):
    """Add the bits of each state's sparse token list. Its tokens are distinct and a state with a
    dense row has none, so adding equals OR-ing; tokens sharing a word need the atomic."""
    pid = tl.program_id(0)
    tiles_per_row = tl.cdiv(max_width, BLOCK)
    for work in tl.range(pid, num_rows * tiles_per_row, tl.num_programs(0)):
        r = (work // tiles_per_row).to(tl.int64)
        cols = (work % tiles_per_row) * BLOCK + tl.arange(0, BLOCK)
        state = tl.load(states_ptr + r)
        start = tl.load(allow_start_ptr + state).to(tl.int64)
        valid = cols < tl.load(fill_width_ptr + state)
        tok = tl.load(allow_tok_ptr + start + cols, mask=valid, other=0).to(tl.int32)
        bit = tl.full((BLOCK,), 1, tl.int32) << (tok & 31)  # bit 31: the negative int32 with that bit
        tl.atomic_add(bitmask_ptr + r * bitmask_stride + (tok >> 5), bit, mask=valid)


# ---- launchers (inputs validated by the callers: widths <= width, tokens < the logits' width) ----


def _grid(work_items: int, max_programs: int) -> tuple[int]:
    return (max(1, min(work_items, max_programs)),)


def _tile(block: int, extent: int) -> int:
    """No wider than the extent (rounded up to a power of two): wider tiles only add masked lanes."""
    return max(16, min(block, triton.next_power_of_2(max(extent, 1))))


def gather_candidate_logits_triton(logits, rows, starts, widths, allow_tok, width, *, block: int, max_programs: int) -> torch.Tensor:
    """float32 (n, width), as gather_candidate_logits_reference."""
    n = rows.shape[0]
    out = torch.empty((n, width), dtype=torch.float32, device=logits.device)
    if n == 0 or width == 0:
        return out
    tile = _tile(block, width)
    _gather_candidates_kernel[_grid(n * triton.cdiv(width, tile), max_programs)](
        logits, rows.contiguous(), starts.contiguous(), widths.contiguous(), allow_tok.contiguous(), out,
        n, width, logits.stride(0), logits.stride(1),
        BLOCK=tile,
    )
    return out


def keep_candidate_logits_triton(
    logits, rows, starts, widths, allow_tok, width, *, block: int, fill_block: int, max_programs: int
) -> None:
    """In place, as keep_candidate_logits_reference: save the allowed values, fill the rows with
    -inf, put the values back (three launches; a row's allowed values wait in an (n, width) buffer)."""
    n = rows.shape[0]
    if n == 0:
        return
    bits = logits.view(INT_VIEW[logits.dtype])
    rows, starts, widths, allow_tok = rows.contiguous(), starts.contiguous(), widths.contiguous(), allow_tok.contiguous()
    args = (rows, starts, widths, allow_tok)
    tile = _tile(block, width)
    saved = torch.empty((n, width), dtype=bits.dtype, device=logits.device)
    grid = _grid(n * triton.cdiv(width, tile), max_programs)
    if width:
        _save_candidates_kernel[grid](bits, *args, saved, n, width, bits.stride(0), bits.stride(1), BLOCK=tile)
    vocab = logits.shape[1]
    fill_tile = _tile(fill_block, vocab)
    _fill_rows_kernel[_grid(n * triton.cdiv(vocab, fill_tile), max_programs)](
        bits, rows, n, vocab, bits.stride(0), bits.stride(1), int(NEG_INF_BITS[logits.dtype]), BLOCK=fill_tile
    )
    if width:
        _restore_candidates_kernel[grid](bits, *args, saved, n, width, bits.stride(0), bits.stride(1), BLOCK=tile)


def fill_tree_bitmask_triton(
    bitmask, states, allow_start, allow_tok, fill_width, max_width, dense_rows, dense_slot, *, block: int, max_programs: int
) -> None:
    """In place on a contiguous int32 (B, W) bitmask, as fill_tree_bitmask_reference: the dense
    rows (or zeros), then the sparse bits added."""
    rows, words = bitmask.shape
    if rows == 0:
        return
    states = states.contiguous()
    has_dense = dense_rows is not None
    word_tile = _tile(block, words)
    _bitmask_dense_kernel[_grid(rows * triton.cdiv(words, word_tile), max_programs)](
        bitmask, states, dense_rows if has_dense else bitmask, dense_slot if has_dense else states,
        rows, words, dense_rows.shape[1] if has_dense else 0, bitmask.stride(0), dense_rows.stride(0) if has_dense else 0,
        HAS_DENSE=has_dense, BLOCK=word_tile,
    )
    if max_width == 0:
        return
    tile = _tile(block, max_width)
    _bitmask_sparse_kernel[_grid(rows * triton.cdiv(max_width, tile), max_programs)](
        bitmask, states, allow_start.contiguous(), allow_tok.contiguous(), fill_width.contiguous(),
        rows, max_width, bitmask.stride(0),
        BLOCK=tile,
    )
