"""Triton kernels for tree candidates, shared by CUDA and Ascend (triton-ascend).

- gather: row i of an (n, width) float32 block holds logits[rows[i]] at its allowed tokens, then
  -inf (the sparse sampling layout);
- keep: rows[i] of the logits keeps only its allowed tokens, every other column -inf;
- fill: the xgrammar-format bitmask of tree states (a precomputed dense row, plus the bits of a
  sparse token list).

Semantics: ../reference/tree.py (gather_candidate_logits_reference, keep_candidate_logits_reference,
fill_tree_bitmask_reference). Each kernel walks (rows, columns) tiles of `block` lanes with a
grid-stride loop: one tile per program on CUDA, a few long-lived programs, one per vector core, on
Ascend; a layout of narrow rows packs many rows into a tile. A row's token list is read only below
its width (an empty row, or padding after it, is never read), so the work follows the candidates,
except where the contract writes whole rows (keep's -inf, the bitmask's words). Keep moves values
as bits through an integer view (exact for every float dtype, no arithmetic the interpreter lacks
for bfloat16); the order of its three steps within a row (save the allowed values, fill the row,
put them back) comes from three launches on one stream, not from barriers inside a program.
Nothing here synchronises with the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..float_bits import INT_VIEW, NEG_INF_BITS

# Bytes one lane of a tile holds (column and token indices, the value, predicates): sizes Ascend
# tiles for the 192 KB unified buffer (launch.ascend_vocab_tile).
CANDIDATE_BYTES_PER_TOKEN = 8 + 8 + 4 + 2
FILL_ROW_BYTES_PER_TOKEN = 8 + 4 + 1
BITMASK_BYTES_PER_WORD = 8 + 4 + 4 + 1


@triton.jit
def _block(work, num_rows, col_tiles, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """Work item `work`: BLOCK_R rows (indices, which exist) by BLOCK_W columns."""
    r = (work // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (work % col_tiles) * BLOCK_W + tl.arange(0, BLOCK_W)
    return r, r < num_rows, cols


@triton.jit
def _candidates(rows_ptr, starts_ptr, widths_ptr, allow_tok_ptr, r, live, cols):
    """(logits row of each layout row, which (row, column) are candidates, their token ids);
    tokens of non-candidates are 0 and never used."""
    row = tl.load(rows_ptr + r, mask=live, other=0).to(tl.int64)
    start = tl.load(starts_ptr + r, mask=live, other=0).to(tl.int64)
    valid = cols[None, :] < tl.load(widths_ptr + r, mask=live, other=0)[:, None]
    tok = tl.load(allow_tok_ptr + start[:, None] + cols[None, :], mask=valid, other=0).to(tl.int64)
    return row, valid, tok


@triton.jit
def _gather_candidates_kernel(
    logits_ptr, rows_ptr, starts_ptr, widths_ptr, allow_tok_ptr, out_ptr,
    num_rows, width, row_stride, col_stride,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    col_tiles = tl.cdiv(width, BLOCK_W)
    for work in tl.range(tl.program_id(0), tl.cdiv(num_rows, BLOCK_R) * col_tiles, tl.num_programs(0)):
        r, live, cols = _block(work, num_rows, col_tiles, BLOCK_R, BLOCK_W)
        row, valid, tok = _candidates(rows_ptr, starts_ptr, widths_ptr, allow_tok_ptr, r, live, cols)
        value = tl.load(logits_ptr + row[:, None] * row_stride + tok * col_stride, mask=valid, other=0.0).to(tl.float32)
        value = tl.where(valid, value, float("-inf"))
        out = out_ptr + r.to(tl.int64)[:, None] * width + cols[None, :]
        tl.store(out, value, mask=live[:, None] & (cols[None, :] < width))


@triton.jit
def _move_candidates_kernel(
    bits_ptr, rows_ptr, starts_ptr, widths_ptr, allow_tok_ptr, saved_ptr,
    num_rows, width, row_stride, col_stride,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, RESTORE: tl.constexpr,
):
    """Copy each row's candidate values (raw bits) into `saved` (n, width), or back (RESTORE)."""
    col_tiles = tl.cdiv(width, BLOCK_W)
    for work in tl.range(tl.program_id(0), tl.cdiv(num_rows, BLOCK_R) * col_tiles, tl.num_programs(0)):
        r, live, cols = _block(work, num_rows, col_tiles, BLOCK_R, BLOCK_W)
        row, valid, tok = _candidates(rows_ptr, starts_ptr, widths_ptr, allow_tok_ptr, r, live, cols)
        in_logits = bits_ptr + row[:, None] * row_stride + tok * col_stride
        in_saved = saved_ptr + r.to(tl.int64)[:, None] * width + cols[None, :]
        if RESTORE:
            tl.store(in_logits, tl.load(in_saved, mask=valid, other=0), mask=valid)
        else:
            tl.store(in_saved, tl.load(in_logits, mask=valid, other=0), mask=valid)


@triton.jit
def _fill_rows_kernel(
    bits_ptr, rows_ptr, num_rows, vocab_size, row_stride, col_stride, neg_inf_bits,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    col_tiles = tl.cdiv(vocab_size, BLOCK_W)
    for work in tl.range(tl.program_id(0), tl.cdiv(num_rows, BLOCK_R) * col_tiles, tl.num_programs(0)):
        r, live, cols = _block(work, num_rows, col_tiles, BLOCK_R, BLOCK_W)
        row = tl.load(rows_ptr + r, mask=live, other=0).to(tl.int64)
        target = bits_ptr + row[:, None] * row_stride + cols.to(tl.int64)[None, :] * col_stride
        tl.store(target, neg_inf_bits, mask=live[:, None] & (cols[None, :] < vocab_size))


@triton.jit
def _bitmask_dense_kernel(
    bitmask_ptr, states_ptr, dense_rows_ptr, dense_slot_ptr,
    num_rows, words, dense_words, bitmask_stride, dense_stride,
    HAS_DENSE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """bitmask[r] := the state's precomputed dense row (zero past its words; all zero without
    dense rows)."""
    col_tiles = tl.cdiv(words, BLOCK_W)
    for work in tl.range(tl.program_id(0), tl.cdiv(num_rows, BLOCK_R) * col_tiles, tl.num_programs(0)):
        r, live, w = _block(work, num_rows, col_tiles, BLOCK_R, BLOCK_W)
        if HAS_DENSE:
            state = tl.load(states_ptr + r, mask=live, other=0)
            slot = tl.load(dense_slot_ptr + state, mask=live, other=0).to(tl.int64)
            inside = live[:, None] & (w[None, :] < dense_words)
            value = tl.load(dense_rows_ptr + slot[:, None] * dense_stride + w[None, :], mask=inside, other=0)
        else:
            value = tl.zeros((BLOCK_R, BLOCK_W), tl.int32)
        target = bitmask_ptr + r.to(tl.int64)[:, None] * bitmask_stride + w[None, :]
        tl.store(target, value, mask=live[:, None] & (w[None, :] < words))


@triton.jit
def _bitmask_sparse_kernel(
    bitmask_ptr, states_ptr, allow_start_ptr, allow_tok_ptr, fill_width_ptr,
    num_rows, max_width, bitmask_stride,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Add the bits of each state's sparse token list. Its tokens are distinct and a state with a
    dense row has none, so adding equals OR-ing; tokens sharing a word need the atomic."""
    col_tiles = tl.cdiv(max_width, BLOCK_W)
    for work in tl.range(tl.program_id(0), tl.cdiv(num_rows, BLOCK_R) * col_tiles, tl.num_programs(0)):
        r, live, cols = _block(work, num_rows, col_tiles, BLOCK_R, BLOCK_W)
        state = tl.load(states_ptr + r, mask=live, other=0)
        start = tl.load(allow_start_ptr + state, mask=live, other=0).to(tl.int64)
        valid = cols[None, :] < tl.load(fill_width_ptr + state, mask=live, other=0)[:, None]
        tok = tl.load(allow_tok_ptr + start[:, None] + cols[None, :], mask=valid, other=0).to(tl.int32)
        bit = tl.full((BLOCK_R, BLOCK_W), 1, tl.int32) << (tok & 31)  # bit 31: the negative int32 with that bit
        tl.atomic_add(bitmask_ptr + r.to(tl.int64)[:, None] * bitmask_stride + (tok >> 5), bit, mask=valid)


# ---- launchers (inputs validated by the callers: widths <= width, tokens < the logits' width) ----


def _shape(block: int, num_rows: int, extent: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_W, work items): tiles of `block` lanes, no wider than the extent (rounded up
    to a power of two: wider tiles only add masked lanes), filled with more rows when the extent is
    narrow (a layout of narrow rows is as few work items as a wide one). BLOCK_R does not follow
    the row count, so a kernel compiles once per power-of-two width, not per batch size."""
    block_w = max(16, min(block, triton.next_power_of_2(max(extent, 1))))
    block_r = max(1, block // block_w)
    return block_r, block_w, triton.cdiv(num_rows, block_r) * triton.cdiv(extent, block_w)


def _launch(kernel, block: int, max_programs: int, num_rows: int, extent: int, *args, **constexprs) -> None:
    block_r, block_w, work = _shape(block, num_rows, extent)
    kernel[(max(1, min(work, max_programs)),)](*args, BLOCK_R=block_r, BLOCK_W=block_w, **constexprs)


def gather_candidate_logits_triton(logits, rows, starts, widths, allow_tok, width, *, block: int, max_programs: int) -> torch.Tensor:
    """float32 (n, width), as gather_candidate_logits_reference."""
    n = rows.shape[0]
    out = torch.empty((n, width), dtype=torch.float32, device=logits.device)
    if n == 0 or width == 0:
        return out
    _launch(
        _gather_candidates_kernel, block, max_programs, n, width,
        logits, rows.contiguous(), starts.contiguous(), widths.contiguous(), allow_tok.contiguous(), out,
        n, width, logits.stride(0), logits.stride(1),
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
    rows = rows.contiguous()
    table = (rows, starts.contiguous(), widths.contiguous(), allow_tok.contiguous())
    saved = torch.empty((n, width), dtype=bits.dtype, device=logits.device)
    strides = (bits.stride(0), bits.stride(1))
    if width:
        _launch(_move_candidates_kernel, block, max_programs, n, width, bits, *table, saved, n, width, *strides, RESTORE=False)
    vocab = logits.shape[1]
    _launch(_fill_rows_kernel, fill_block, max_programs, n, vocab, bits, rows, n, vocab, *strides, int(NEG_INF_BITS[logits.dtype]))
    if width:
        _launch(_move_candidates_kernel, block, max_programs, n, width, bits, *table, saved, n, width, *strides, RESTORE=True)


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
    _launch(
        _bitmask_dense_kernel, block, max_programs, rows, words,
        bitmask, states, dense_rows if has_dense else bitmask, dense_slot.contiguous() if has_dense else states,
        rows, words, dense_rows.shape[1] if has_dense else 0, bitmask.stride(0), dense_rows.stride(0) if has_dense else 0,
        HAS_DENSE=has_dense,
    )
    if max_width == 0:
        return
    _launch(
        _bitmask_sparse_kernel, block, max_programs, rows, max_width,
        bitmask, states, allow_start.contiguous(), allow_tok.contiguous(), fill_width.contiguous(),
        rows, max_width, bitmask.stride(0),
    )
