"""Every backend's bitmask kernel equals the torch reference and xgrammar, on random inputs."""
import pytest
import torch
import xgrammar
from hypothesis import given, settings
from hypothesis import strategies as st

import logitgate
from logitgate.backends.reference import apply_token_bitmask_reference, pack_bitmask, unpack_bitmask

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def bitmask_cases(draw):
    rows = draw(st.integers(1, 6))
    vocab = draw(st.integers(1, 300))
    width = vocab + draw(st.sampled_from([0, 0, 7, 40]))  # logits may be wider than the vocab
    dtype = draw(st.sampled_from(DTYPES))
    density = draw(st.sampled_from([0.0, 0.01, 0.5, 0.99, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    use_indices = draw(st.booleans())
    indices = sorted(draw(st.sets(st.integers(0, rows - 1), min_size=1))) if use_indices else None
    return rows, vocab, width, dtype, density, seed, indices


def make_case(rows, vocab, width, dtype, density, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, generator=g).to(dtype)
    allowed = torch.rand(rows, vocab, generator=g) < density
    return logits, pack_bitmask(allowed)


def to_device(backend, *tensors):
    return [t.to(backend.device) for t in tensors]


@given(case=bitmask_cases())
def test_backend_matches_reference_and_xgrammar(backend, case):
    rows, vocab, width, dtype, density, seed, indices = case
    logits, bitmask = make_case(rows, vocab, width, dtype, density, seed)

    expected = logits.clone()
    ref_rows = None if indices is None else torch.tensor(indices)
    apply_token_bitmask_reference(expected, bitmask, ref_rows, vocab)

    # xgrammar's documented semantics, as its torch kernel implements them (see
    # test_matches_xgrammar_cpu_kernel for why its CPU kernel is not the oracle here).
    xgr = logits.clone()
    xgrammar.apply_token_bitmask_inplace(xgr, bitmask, vocab_size=vocab, indices=indices, backend="torch_native")
    assert torch.equal(expected, xgr)

    got, mask = to_device(backend, logits.clone(), bitmask)
    logitgate.apply_token_bitmask_inplace(got, mask, indices=indices, vocab_size=vocab, backend=backend)
    assert got.dtype == dtype
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 32000), (8, 4096), (4, 320)])
@pytest.mark.parametrize("indices", [None, [0, 2]])
def test_matches_xgrammar_cpu_kernel(dtype, shape, indices):
    """xgrammar 0.2.8's CPU kernel disagrees with its own documented semantics in corners: with a
    partial last word it masks token 0 of later all-allowed rows, with vocab < 32 it masks later
    rows wrongly, and it masks padding tokens past vocab_size in the last word. logitgate follows
    the documentation (and xgrammar's torch/Triton kernels); here it matches the CPU kernel on the
    shapes where that kernel is right."""
    rows, vocab = shape
    logits, bitmask = make_case(rows, vocab, vocab, dtype, 0.5, 99)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, indices=indices)
    got = logits.clone()
    logitgate.apply_token_bitmask_inplace(got, bitmask, indices=indices)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 32000), (3, 9000 + 17), (2, 33)])
def test_larger_shapes_cross_chunks_and_tiles(backend, dtype, shape):
    rows, vocab = shape
    logits, bitmask = make_case(rows, vocab, vocab, dtype, 0.5, 1234)
    # Whole words of 0 and of -1 exercise the fast paths.
    bitmask[:, 0] = 0
    bitmask[:, -1] = -1
    expected = logits.clone()
    apply_token_bitmask_reference(expected, bitmask, None, vocab)
    got, mask = to_device(backend, logits.clone(), bitmask)
    logitgate.apply_token_bitmask_inplace(got, mask, backend=backend)
    assert torch.equal(got.cpu(), expected)


def test_one_dimensional_logits_and_default_vocab(backend):
    logits, bitmask = make_case(1, 100, 100, torch.float32, 0.3, 7)
    flat, flat_mask = logits[0].clone(), bitmask[0].clone()
    expected = flat.clone()
    xgrammar.apply_token_bitmask_inplace(expected, flat_mask)
    flat, flat_mask = to_device(backend, flat, flat_mask)
    logitgate.apply_token_bitmask_inplace(flat, flat_mask, backend=backend)
    assert torch.equal(flat.cpu(), expected)


def test_indices_leave_other_rows_untouched(backend):
    logits, bitmask = make_case(4, 64, 64, torch.bfloat16, 0.0, 3)
    got, mask = to_device(backend, logits.clone(), bitmask)
    logitgate.apply_token_bitmask_inplace(got, mask, indices=[1, 3], backend=backend)
    got = got.cpu()
    assert torch.equal(got[[0, 2]], logits[[0, 2]])
    assert torch.isinf(got[[1, 3]]).all()


def test_rows_without_indices_need_equal_batch():
    logits = torch.zeros(3, 64)
    with pytest.raises(ValueError, match="3 rows but the bitmask has 2"):
        logitgate.apply_token_bitmask_inplace(logits, logitgate.allocate_token_bitmask(2, 64))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: (torch.zeros(2, 64, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32), {}), "logits dtype"),
        (lambda: (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64), {}), "bitmask dtype must be int32"),
        (lambda: (torch.zeros(2, 2, 64), torch.zeros(2, 2, dtype=torch.int32), {}), "1-D or 2-D"),
        (lambda: (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32, device="meta"), {}), "on meta"),
        (lambda: (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), {"indices": [0, 2]}), "row 2"),
        (lambda: (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), {"indices": [-1]}), "row -1"),
        (lambda: (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), {"indices": torch.tensor([5])}), "row 5"),
        (lambda: (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), {"vocab_size": 65}), "vocab_size 65"),
        (lambda: (torch.zeros(64, 2).t(), torch.zeros(2, 2, dtype=torch.int32), {}), "contiguous"),
        (lambda: (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), {"backend": "npu-emulated-x"}), "unknown device"),
    ],
)
def test_bad_input_raises_and_leaves_logits_untouched(make, message):
    logits, bitmask, kwargs = make()
    before = logits.clone()
    with pytest.raises(ValueError, match=message):
        logitgate.apply_token_bitmask_inplace(logits, bitmask, **kwargs)
    assert torch.equal(logits, before)


def test_short_bitmask_warns_like_xgrammar():
    logits = torch.zeros(1, 70)
    with pytest.warns(UserWarning, match="covers only 64 tokens"):
        logitgate.apply_token_bitmask_inplace(logits, torch.zeros(1, 2, dtype=torch.int32))
    assert torch.isinf(logits[0, :64]).all() and (logits[0, 64:] == 0).all()


@given(st.lists(st.lists(st.integers(0, 99), max_size=20), min_size=1, max_size=5))
def test_pack_unpack_round_trip(rows):
    bitmask = logitgate.bitmask_from_token_ids(rows, 100)
    assert bitmask.shape == logitgate.get_bitmask_shape(len(rows), 100)
    assert logitgate.token_ids_from_bitmask(bitmask, 100) == [sorted(set(r)) for r in rows]
    assert torch.equal(pack_bitmask(unpack_bitmask(bitmask, 100)), bitmask)


def test_allocate_fill_reset():
    bitmask = logitgate.allocate_token_bitmask(2, 70)
    assert bitmask.dtype == torch.int32 and bitmask.shape == (2, 3) and (bitmask == -1).all()
    logitgate.fill_bitmask_row(bitmask, 1, [0, 69], 70)
    assert logitgate.token_ids_from_bitmask(bitmask, 70)[1] == [0, 69]
    with pytest.raises(ValueError, match="token id 70 in row 0"):
        logitgate.fill_bitmask_row(bitmask, 0, [70], 70)
    logitgate.reset_token_bitmask(bitmask)
    assert (bitmask == -1).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
@pytest.mark.parametrize("use_indices", [False, True])
def test_cpu_parallel_kernel_matches_reference(dtype, density, use_indices):
    """Batches above the serial cutoff take the parallel numba kernel; smaller ones the serial one.
    Padded rows (logits wider than the vocabulary, a strided view) and row indices on both."""
    from logitgate.backends.cpu.bitmask_kernels import _SERIAL_MAX_WORDS

    rows, vocab = 6, 32000 + 17
    assert rows * ((vocab + 31) // 32) > _SERIAL_MAX_WORDS  # this test must reach the parallel kernel
    g = torch.Generator().manual_seed(11)
    wide = torch.randn(rows, vocab + 40, generator=g).to(dtype)
    bitmask = pack_bitmask(torch.rand(rows, vocab, generator=g) < density)
    bitmask[:, 5] = 0
    bitmask[:, 7] = -1
    indices = [0, 3, 5] if use_indices else None
    expected = wide.clone()
    apply_token_bitmask_reference(expected, bitmask, None if indices is None else torch.tensor(indices), vocab)
    got = wide.clone()
    logitgate.apply_token_bitmask_inplace(got[:, :vocab], bitmask, indices=indices, vocab_size=vocab, backend="cpu")
    assert torch.equal(got, expected)


def _cuda_kernel_backends():
    """The CUDA backend's own dispatch: interpreted on CPU tensors, and the real one on a GPU."""
    from logitgate.backends import probe_cuda
    from tests.helpers.cuda_variants import INTERPRETER, interpreted_cuda_backend

    found = [interpreted_cuda_backend()] if INTERPRETER else []
    if probe_cuda().available:
        found.append(logitgate.get_backend("cuda"))
    return found


CUDA_KERNEL_BACKENDS = _cuda_kernel_backends()


@st.composite
def tiled_bitmask_cases(draw):
    """Rows crossing tiles (4096 float32 / 8192 16-bit tokens), each tile all allowed, all blocked,
    a few blocked (the predicated store), or mixed (the load-select-store)."""
    rows = draw(st.integers(1, 3))
    vocab = draw(st.sampled_from([1, 31, 33, 300, 4096, 4097, 9000]))
    width = vocab + draw(st.sampled_from([0, 0, 9]))
    dtype = draw(st.sampled_from(DTYPES))
    density = draw(st.sampled_from([0.0, 0.02, 0.5, 0.98, 0.999, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    indices = sorted(draw(st.sets(st.integers(0, rows - 1), min_size=1))) if draw(st.booleans()) else None
    return rows, vocab, width, dtype, density, seed, indices


@pytest.mark.skipif(not CUDA_KERNEL_BACKENDS, reason="needs TRITON_INTERPRET=1 or a GPU")
@pytest.mark.parametrize("cuda", CUDA_KERNEL_BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("variant", ["current", "v2"])
@settings(max_examples=15)
@given(case=tiled_bitmask_cases())
def test_cuda_kernel_variants_match_reference(cuda, variant, case):
    from logitgate.backends.variants import selected

    rows, vocab, width, dtype, density, seed, indices = case
    logits, bitmask = make_case(rows, vocab, width, dtype, density, seed)
    if vocab > 4096:  # one whole tile of each kind
        bitmask[:, : 4096 // 32] = 0 if seed % 2 else -1
    expected = logits.clone()
    apply_token_bitmask_reference(expected, bitmask, None if indices is None else torch.tensor(indices), vocab)
    got, mask = to_device(cuda, logits.clone(), bitmask)
    with selected("bitmask", variant):
        logitgate.apply_token_bitmask_inplace(got, mask, indices=indices, vocab_size=vocab, backend=cuda)
    assert torch.equal(got.cpu(), expected)
