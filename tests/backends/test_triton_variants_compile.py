"""The v2 CUDA kernels (LOGITGATE_CUDA_KERNELS=v2) compile for an H100/H200 (sm_90) on a host
without a GPU, for every specialisation the launchers use: the interpreter forgives what the
compiler does not, and these kernels have had no GPU run yet. Compilation only; results are checked
under the interpreter (test_bitmask_apply.py, test_sampling_variants.py, test_rejection_variants.py)."""
import json

import pytest

triton = pytest.importorskip("triton")
try:
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401 - the NVIDIA code generator is installed
except ImportError:  # pragma: no cover - e.g. triton-ascend
    pytest.skip("this triton has no NVIDIA code generator", allow_module_level=True)

from tests.helpers.triton_compile import compile_all, compile_in_subprocess  # noqa: E402


def _cases():
    """(kernel, signature, constexprs, num_warps) for every specialisation a v2 launcher can ask for."""
    from logitgate.backends.triton import bitmask

    for bits, block in (("i32", 4096), ("i16", 8192)):
        for has_rows in (False, True):
            sig = {"bits_ptr": f"*{bits}", "bitmask_ptr": "*i32", "rows_ptr": "*i64", "vocab_size": "i32",
                   "tiles_per_row": "i32", "logits_row_stride": "i32", "bitmask_row_stride": "i32",
                   "neg_inf_bits": "i32", "HAS_ROWS": "constexpr", "BLOCK": "constexpr", "SPARSE": "constexpr"}
            yield bitmask._apply_token_bitmask_tile_kernel, sig, {"HAS_ROWS": has_rows, "BLOCK": block, "SPARSE": 16}, 8
    from logitgate.backends.triton import philox
    from logitgate.backends.triton import sampling_v2 as sv2

    yield philox._philox_exponential_kernel, {"seed_ptr": "*i64", "out_ptr": "*fp32", "vocab_size": "i32",
                                              "out_stride": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024}, 4
    yield sv2._race_partial_kernel, {"probs_ptr": "*fp32", "seed_ptr": "*i64", "part_ptr": "*i32", "vocab_size": "i32",
                                     "probs_stride": "i32", "num_chunks": "i32", "CHUNK": "constexpr"}, {"CHUNK": 8192}, 8
    yield sv2._race_merge_kernel, {"part_ptr": "*i32", "out_ptr": "*i64", "num_chunks": "i32", "CHUNKS": "constexpr"}, {"CHUNKS": 32}, 4
    for has_t in (False, True):
        sig = {"logits_ptr": "*fp32", "temperature_ptr": "*fp32" if has_t else "*i64", "work_ptr": "*i32", "vocab_size": "i32",
               "logits_stride": "i32", "num_chunks": "i32", "top": "i32", "HAS_TEMPERATURE": "constexpr",
               "CHUNK": "constexpr", "SLOTS": "constexpr"}
        yield sv2._chunk_candidates_kernel, sig, {"HAS_TEMPERATURE": has_t, "CHUNK": 8192, "SLOTS": 64}, 8
        for has_p in (False, True):
            sig = {"work_ptr": "*i32", "logits_ptr": "*fp32", "temperature_ptr": "*fp32" if has_t else "*i64", "k_ptr": "*i64",
                   "p_ptr": "*fp32", "seed_ptr": "*i64", "out_ptr": "*i64", "vocab_size": "i32", "logits_stride": "i32",
                   "num_chunks": "i32", "top": "i32", "HAS_TEMPERATURE": "constexpr", "HAS_P": "constexpr",
                   "CHUNKS": "constexpr", "SLOTS": "constexpr", "BLOCK_V": "constexpr"}
            yield sv2._merge_sample_kernel, sig, {"HAS_TEMPERATURE": has_t, "HAS_P": has_p, "CHUNKS": 16, "SLOTS": 64,
                                                   "BLOCK_V": 4096}, 8
    from logitgate.backends.triton import rejection_v2 as rv2

    sizes = {"vocab_size": "i32", "logits_stride": "i32", "probs_stride": "i32", "num_chunks": "i32"}
    for logits in ("fp32", "bf16"):
        for has_t in (False, True):
            sig = {"logits_ptr": f"*{logits}", "temperature_ptr": "*fp32" if has_t else "*i32", "token_request_ptr": "*i64",
                   "stats_ptr": "*i32", "vocab_size": "i32", "logits_stride": "i32", "num_chunks": "i32",
                   "HAS_TEMPERATURE": "constexpr", "CHUNK": "constexpr"}
            yield rv2._row_stats_kernel, sig, {"HAS_TEMPERATURE": has_t, "CHUNK": 8192}, 8
    for all_greedy, has_t, has_probs in ((True, False, False), (False, False, True), (False, True, False), (False, True, True)):
        sig = {"stats_ptr": "*i32", "cu_ptr": "*i32", "draft_ptr": "*i64", "logits_ptr": "*fp32",
               "temperature_ptr": "*fp32", "token_request_ptr": "*i64", "draft_probs_ptr": "*fp32", "uniform_ptr": "*fp64",
               "accepted_ptr": "*i32", "lse_ptr": "*fp32", "correction_ptr": "*i32", "random_ptr": "*i32", **sizes,
               "ALL_GREEDY": "constexpr", "HAS_TEMPERATURE": "constexpr", "HAS_DRAFT_PROBS": "constexpr", "CHUNKS": "constexpr"}
        yield rv2._accept_kernel, sig, {"ALL_GREEDY": all_greedy, "HAS_TEMPERATURE": has_t, "HAS_DRAFT_PROBS": has_probs,
                                        "CHUNKS": 16}, 4
        if not all_greedy:
            sig = {"cu_ptr": "*i32", "draft_ptr": "*i64", "logits_ptr": "*fp32", "temperature_ptr": "*fp32",
                   "token_request_ptr": "*i64", "draft_probs_ptr": "*fp32", "accepted_ptr": "*i32", "lse_ptr": "*fp32",
                   "random_ptr": "*i32", "seed_ptr": "*i64", "part_ptr": "*i32", **sizes, "HAS_TEMPERATURE": "constexpr",
                   "HAS_DRAFT_PROBS": "constexpr", "HAS_RANDOM": "constexpr", "CHUNK": "constexpr"}
            yield rv2._recover_partial_kernel, sig, {"HAS_TEMPERATURE": has_t, "HAS_DRAFT_PROBS": has_probs,
                                                     "HAS_RANDOM": has_t, "CHUNK": 8192}, 8
    for write in (False, True):
        sig = {"cu_ptr": "*i32", "draft_ptr": "*i64", "bonus_ptr": "*i64", "accepted_ptr": "*i32", "lse_ptr": "*fp32",
               "random_ptr": "*i32", "correction_ptr": "*i32", "part_ptr": "*i32", "out_ptr": "*i32", "num_chunks": "i32",
               "vocab_size": "i32", "out_stride": "i32", "HAS_RANDOM": "constexpr", "HAS_CORRECTION": "constexpr",
               "WRITE_OUTPUT": "constexpr", "CHUNKS": "constexpr", "WIDTH": "constexpr"}
        yield rv2._recover_merge_kernel, sig, {"HAS_RANDOM": True, "HAS_CORRECTION": write, "WRITE_OUTPUT": write,
                                               "CHUNKS": 16, "WIDTH": 8}, 4


def test_v2_kernels_compile_for_sm90(tmp_path):
    results = compile_in_subprocess(__file__, tmp_path)
    assert len(results) == len(list(_cases()))
    assert {case: r for case, r in results.items() if r != "ok"} == {}


if __name__ == "__main__":
    print(json.dumps(compile_all(_cases()), indent=1))
