"""The Triton tree kernels compile for an H100 (sm_90) on a host without a GPU: the interpreter
forgives what the compiler does not (types of scalars and stores, broadcasting, constexpr
branches), and no GPU is at hand to run them natively. Compilation only; results are checked under
the interpreter (test_tree_kernel_edges.py, test_tree_candidate_kernels.py, test_tree_kernels.py)."""
import json

import pytest

triton = pytest.importorskip("triton")
try:
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401 - the NVIDIA code generator is installed
except ImportError:  # pragma: no cover - e.g. triton-ascend
    pytest.skip("this triton has no NVIDIA code generator", allow_module_level=True)

from logitgate.backends.triton import tree  # noqa: E402 - after the skip above
from tests.helpers.triton_compile import compile_all, compile_in_subprocess  # noqa: E402

TABLE = {"rows_ptr": "*i64", "starts_ptr": "*i64", "widths_ptr": "*i64", "allow_tok_ptr": "*i32"}
SIZES = {"num_rows": "i32", "width": "i32", "row_stride": "i32", "col_stride": "i32"}
TILE = {"BLOCK_R": "constexpr", "BLOCK_W": "constexpr"}


def _cases():
    # (kernel, signature, constexprs): narrow rows packed (64 x 16) and one wide row (1 x 1024);
    # the integer views of float32 (i32) and of the 16-bit floats (i16).
    for logits, shape in (("fp32", (1, 1024)), ("bf16", (64, 16)), ("fp16", (1, 1024))):
        sig = {"logits_ptr": f"*{logits}", **TABLE, "out_ptr": "*fp32", **SIZES, **TILE}
        yield tree._gather_candidates_kernel, sig, dict(zip(("BLOCK_R", "BLOCK_W"), shape))
    for bits, shape in (("i32", (1, 1024)), ("i16", (64, 16))):
        tile = dict(zip(("BLOCK_R", "BLOCK_W"), shape))
        for restore in (False, True):
            sig = {"bits_ptr": f"*{bits}", **TABLE, "saved_ptr": f"*{bits}", **SIZES, **TILE, "RESTORE": "constexpr"}
            yield tree._move_candidates_kernel, sig, {**tile, "RESTORE": restore}
        sig = {"bits_ptr": f"*{bits}", "rows_ptr": "*i64", "num_rows": "i32", "vocab_size": "i32", "row_stride": "i32",
               "col_stride": "i32", "neg_inf_bits": "i32", **TILE}
        yield tree._fill_rows_kernel, sig, tile
    for has_dense in (True, False):
        sig = {"bitmask_ptr": "*i32", "states_ptr": "*i64", "dense_rows_ptr": "*i32", "dense_slot_ptr": "*i64",
               "num_rows": "i32", "words": "i32", "dense_words": "i32", "bitmask_stride": "i32", "dense_stride": "i32",
               "HAS_DENSE": "constexpr", **TILE}
        yield tree._bitmask_dense_kernel, sig, {"HAS_DENSE": has_dense, "BLOCK_R": 4, "BLOCK_W": 256}
    sig = {"bitmask_ptr": "*i32", "states_ptr": "*i64", "allow_start_ptr": "*i64", "allow_tok_ptr": "*i32",
           "fill_width_ptr": "*i32", "num_rows": "i32", "max_width": "i32", "bitmask_stride": "i32", **TILE}
    yield tree._bitmask_sparse_kernel, sig, {"BLOCK_R": 8, "BLOCK_W": 128}


def test_tree_kernels_compile_for_sm90(tmp_path):
    results = compile_in_subprocess(__file__, tmp_path)
    assert len(results) == len(list(_cases())) == 12
    assert {case: r for case, r in results.items() if r != "ok"} == {}


if __name__ == "__main__":
    print(json.dumps(compile_all(_cases())))
