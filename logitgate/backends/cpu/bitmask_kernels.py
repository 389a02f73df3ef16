"""numba kernels for the CPU backend.

Kernels work on integer views of the logits and write the -inf bit pattern of the logits' dtype,
so one kernel body serves float32 (int32 view) and float16/bfloat16 (int16 view) alike.

Speed notes (measured with logitgate/bench/bitmask.py; 2-core AVX-512 host):
- Each 32-token word is masked with explicit LLVM vector code (the intrinsics below): a word of 0
  is one splat store of -inf, any other word one vector load, select and store, the word itself
  bitcast to the <32 x i1> select mask; words of -1 are skipped. Written as numba loops instead
  (`if` per token, `x if bit else neg_inf`, int64 shift counts) the loop stays scalar and branchy:
  5-70x slower, worst for 16-bit dtypes at 50% allowed (a mispredicted branch per token). The
  branch-free `(x & keep) | (neg_inf & ~keep)` loop does vectorize, into masked stores, but those
  are up to 2.5x slower while the logits sit in cache, and a 32-token fill loop is unrolled into
  scalar stores (2x slower at 1% allowed).
- Tensors reach the kernels as data_ptr() integers and row strides, indexed through typed pointers:
  scalar arguments dispatch in ~1 us where numpy views of the tensors cost ~3 us, and there is one
  compiled specialization per element width whatever the tensors' layout.
- Small batches run a serial kernel: there the parallel launch costs more than it saves.
"""
from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..float_bits import NEG_INF_BITS

# Words of the bitmask per parallel work item (4096 tokens): a 128k-token row spreads over all
# cores, and scheduling overhead stays negligible.
_CHUNK_WORDS = 128
# Up to this many bitmask words in total (131k tokens) the serial kernel is as fast or faster.
_SERIAL_MAX_WORDS = 4096



@intrinsic
def _pointer(typingctx, address, like):  # pragma: no cover - typing/codegen run inside numba
    """The integer `address` as a pointer to values of `like`'s type (indexing it does no bounds
    check and no negative wraparound)."""
    pointer = types.CPointer(like)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(address, like), codegen


def _word_vector(context, builder, pointer_type, pointer, index):
    """(address of pointer[index : index + 32] as a <32 x T> vector, T's alignment)."""
    element = context.get_value_type(pointer_type.dtype)
    address = builder.gep(pointer, [index])
    return builder.bitcast(address, ir.VectorType(element, 32).as_pointer()), context.get_abi_sizeof(element)


def _splat32(builder, value):
    """A <32 x T> vector with every lane `value`."""
    vector_type = ir.VectorType(value.type, 32)
    lane0 = builder.insert_element(ir.Constant(vector_type, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), 32), [0] * 32)
    return builder.shuffle_vector(lane0, ir.Constant(vector_type, ir.Undefined), zeros)


@intrinsic
def _fill_word(typingctx, pointer, index, value):  # pragma: no cover - typing/codegen run inside numba
    """pointer[index : index + 32] = value, as one vector store."""

    def codegen(context, builder, signature, args):
        address, align = _word_vector(context, builder, pointer, args[0], args[1])
        builder.store(_splat32(builder, args[2]), address, align=align)
        return context.get_dummy_value()

    return types.none(pointer, index, pointer.dtype), codegen


@intrinsic
def _mask_word(typingctx, pointer, index, word, value):  # pragma: no cover - typing/codegen run inside numba
    """pointer[index + j] = value for every bit j of the int32 `word` that is 0: one vector load,
    select (the word bitcast to the <32 x i1> mask: bit j is lane j) and store."""

    def codegen(context, builder, signature, args):
        address, align = _word_vector(context, builder, pointer, args[0], args[1])
        keep = builder.bitcast(args[2], ir.VectorType(ir.IntType(1), 32))
        logits = builder.load(address, align=align)
        builder.store(builder.select(keep, logits, _splat32(builder, args[3])), address, align=align)
        return context.get_dummy_value()

    return types.none(pointer, index, types.int32, pointer.dtype), codegen


@numba.njit(cache=True, nogil=True)
def _mask_words(bits, masks, bits_off, mask_off, w_start, w_end, vocab_size, neg_inf):  # pragma: no cover - jitted
    """Mask the tokens of bitmask words [w_start, w_end) of one row, whose first token is
    bits[bits_off] and first word masks[mask_off]."""
    full_words = vocab_size // 32
    for w in range(w_start, min(w_end, full_words)):
        word = masks[mask_off + w]
        if word == -1:  # all 32 tokens allowed: the common case for loose grammars
            continue
        if word == 0:  # none allowed, the common case for tight grammars: no need to load the logits
            _fill_word(bits, bits_off + w * 32, neg_inf)
        else:
            _mask_word(bits, bits_off + w * 32, word, neg_inf)
    if w_start <= full_words < w_end and full_words * 32 < vocab_size:  # the partial last word
        word = masks[mask_off + full_words]
        base = bits_off + full_words * 32
        for j in range(vocab_size - full_words * 32):
            if (word >> np.int32(j)) & np.int32(1) == 0:
                bits[base + j] = neg_inf


@numba.njit(parallel=True, cache=True, nogil=True)
def _apply_parallel(bits_addr, bits_stride, masks_addr, mask_stride, rows_addr, num_rows, vocab_size, neg_inf):  # pragma: no cover - jitted
    """Parallel over rows x _CHUNK_WORDS-word chunks. Tensors come as data_ptr() addresses and row
    strides (in elements); rows_addr points at num_rows int64 row ids, or is 0 for rows 0..num_rows-1."""
    bits = _pointer(bits_addr, neg_inf)
    masks = _pointer(masks_addr, np.int32(0))
    rows = _pointer(rows_addr, np.int64(0))
    num_words = (vocab_size + 31) // 32
    chunks = (num_words + _CHUNK_WORDS - 1) // _CHUNK_WORDS
    for item in numba.prange(num_rows * chunks):
        i = item // chunks
        r = rows[i] if rows_addr else i
        w_start = (item - i * chunks) * _CHUNK_WORDS
        _mask_words(bits, masks, r * bits_stride, r * mask_stride, w_start, w_start + _CHUNK_WORDS, vocab_size, neg_inf)


@numba.njit(cache=True, nogil=True)
def _apply_serial(bits_addr, bits_stride, masks_addr, mask_stride, rows_addr, num_rows, vocab_size, neg_inf):  # pragma: no cover - jitted
    """_apply_parallel for small batches, on the calling thread."""
    bits = _pointer(bits_addr, neg_inf)
    masks = _pointer(masks_addr, np.int32(0))
    rows = _pointer(rows_addr, np.int64(0))
    num_words = (vocab_size + 31) // 32
    for i in range(num_rows):
        r = rows[i] if rows_addr else i
        _mask_words(bits, masks, r * bits_stride, r * mask_stride, 0, num_words, vocab_size, neg_inf)


def apply_token_bitmask_cpu(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None, vocab_size: int
) -> None:
    """In-place bitmask apply on CPU tensors (2-D, contiguous in the last dimension, validated);
    same semantics as the reference."""
    # stride() then [0]: a third of the cost of stride(0).
    logits_stride, bitmask_stride = logits.stride(), bitmask.stride()
    # The kernels write through raw pointers: refuse tensors that would make them write out of
    # bounds, even from callers that skipped the public checks (costs ~0.1 us).
    if not (logits.is_cpu and bitmask.is_cpu and logits_stride[1] == 1 and bitmask_stride[1] == 1):
        raise ValueError(
            f"the CPU bitmask kernel needs CPU tensors contiguous in the last dimension, got logits on {logits.device} "
            f"with strides {logits_stride} and a bitmask on {bitmask.device} with strides {bitmask_stride}"
        )
    if rows is None:
        rows_addr, num_rows = 0, logits.shape[0]
    else:
        rows = rows.to(torch.int64).contiguous()  # referenced until the kernel returns
        rows_addr, num_rows = rows.data_ptr(), rows.shape[0]
    kernel = _apply_serial if num_rows * bitmask.shape[1] <= _SERIAL_MAX_WORDS else _apply_parallel
    kernel(
        logits.data_ptr(), logits_stride[0], bitmask.data_ptr(), bitmask_stride[0],
        rows_addr, num_rows, vocab_size, NEG_INF_BITS[logits.dtype],
    )
