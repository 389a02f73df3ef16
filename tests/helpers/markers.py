"""The markers tests/conftest.py sets on every collected test (registered in pyproject.toml):
`engine` for tests/vllm_engine, `interpreter` for Triton kernels run under TRITON_INTERPRET=1, and
`slow` for the tests listed in SLOW. `make test-fast` runs `-m "not slow and not interpreter"`."""
from pathlib import Path

from logitgate.backends import Backend
from tests.helpers.sampling_helpers import interpreted_triton

TESTS_DIR = Path(__file__).resolve().parents[1]
ENGINE_DIR = TESTS_DIR / "vllm_engine"

# Tests over ~5 s on this project's shared 2-core CPU host (`--durations=0`, numba's compile cache
# warm), and the few over ~1 s that kept `make test-fast` over a minute: a folder ("x/"), a file,
# or "file::test" (all its parameters), relative to tests/. Mostly subprocesses, real tokenizers,
# the demo models, and chi-square tests with many samples. tests/test_markers.py checks that every
# entry still names a test.
SLOW = (
    "backends/test_bitmask_apply.py::test_cpu_parallel_kernel_matches_reference",
    "backends/test_device_layer.py::test_cli_rejects_unknown_device",
    "backends/test_device_layer.py::test_doctor_shows_why_npu_is_unusable",
    "backends/test_import_isolation.py::test_triton_kernels_do_not_import_numba",
    "backends/test_npu_by_name.py",
    "backends/test_triton_tree_compile.py",
    "backends/test_triton_variants_compile.py",
    "cli/test_bench_cli.py::test_plot_is_log_scale_with_machine_and_threads_in_title",
    "cli/test_demo_assets.py",
    "cli/test_demo_cli.py::test_local_hugging_face_model_with_ngram_drafts",
    "cli/test_demo_cli.py::test_npu_emulated_with_a_user_tree",
    "cli/test_demo_cli.py::test_progress_lines_per_phase_on_stderr_never_in_the_json",
    "cli/test_tree_cli.py::test_build_for_llama3_and_its_start_tokens",
    "decode/test_generate.py::test_constrained_sampling_follows_the_exact_distribution",
    "decode/test_generate.py::test_sampled_tree_rows_in_a_mixed_batch_follow_the_exact_distribution",
    "decode/test_generate_forced.py::test_sampled_outputs_follow_the_exact_distribution",
    "hostile/test_hostile_generate.py::test_demo_with_a_tree_ending_in_a_separator_matches_plain_greedy",
    "hostile/test_hostile_manager_threads.py::test_real_xgrammar_matchers_survive_two_threads_stepping_the_same_batch",
    "hostile/test_hostile_sampling.py::test_rejection_kernels_on_rows_without_a_distribution_match_reference",
    "hostile/test_hostile_sampling.py::test_sampler_rows_without_a_distribution_give_the_fallback_token",
    "integrations/llama_cpp/",
    "integrations/test_hf_speculative.py::test_a_grammars_forced_strings_are_drafted_and_verified",
    "integrations/test_hf_speculative.py::test_greedy_equals_target_generate",
    "integrations/test_vllm_tree_admission.py::test_a_large_tree_is_parsed_in_the_admission_process",
    "integrations/test_vllm_tree_admission.py::test_an_admission_process_that_ends_fails_that_parse_alone",
    "integrations/test_hf_speculative_padding.py::test_padding_is_never_drafted",
    "integrations/test_transformers.py::test_generation_stops_at_a_tree_end_token_that_is_not_eos",
    "integrations/test_transformers.py::test_grammar_every_sequence_matches",
    "integrations/test_transformers.py::test_tree_every_sequence_is_a_catalog_path",
    "integrations/test_transformers.py::test_tree_processor_reset",
    "integrations/test_transformers.py::test_tree_processor_reused_across_generations",
    "models/test_hf_byte_tokenizer.py::test_demo_runs_on_the_embedded_model_directory",
    "models/test_hf_byte_tokenizer.py::test_hugging_face_loads_model_and_tokenizer_from_one_directory",
    "models/test_json_writer.py::test_a_recipe_trains_to_the_same_weights_twice",
    "models/test_json_writer.py::test_at_temperature_1_it_leaves_the_format_sometimes",
    "models/test_json_writer.py::test_greedy_records_are_valid_for_both_schemas_most_of_the_time",
    "models/test_json_writer.py::test_the_model_folder_is_built_once_and_loads_in_transformers",
    "models/test_real_vocab.py",
    "sampling/test_processors_fuzz.py::test_processors_follow_a_shuffled_persistent_batch",
    "sampling/test_rejection_distribution.py::test_constrained_target_under_a_bitmask",
    "sampling/test_rejection_distribution.py::test_emitted_tokens_follow_the_target",
    "sampling/test_sampling_distributions.py::test_sampler_filters_give_the_reference_distribution",
    "sampling/test_sampling_ops.py::test_top_k_top_p_large_vocab",
    "sampling/test_sparse_sampling.py::test_fused_draws_use_the_samplers_random_numbers",
    "sampling/test_sparse_sampling.py::test_mixed_dense_and_fused_rows_follow_the_masked_distribution",
    "sampling/test_sparse_sampling.py::test_random_draws_follow_the_masked_distribution",
    "sampling/test_sparse_sampling.py::test_sample_candidates_draws_the_masked_softmax",
    "scripts/test_gpu_check.py",
    "structured/tree/test_tree_build.py::test_build_trie_matches_the_reference",
    "structured/tree/test_tree_real_tokenizers.py",
    "structured/test_forced.py",
    "structured/test_xgrammar_backend.py::test_real_vocabulary_json_bitmask_allows_exactly_the_right_tokens",
    "test_markers.py::test_interpreter_marks_exactly_the_interpreted_triton_instances",
    "test_readme.py",
)


def is_slow(item, path: Path) -> bool:
    rel = path.relative_to(TESTS_DIR).as_posix()
    for entry in SLOW:
        where, _, name = entry.partition("::")
        if (rel.startswith(where) if where.endswith("/") else rel == where) and name in ("", item.originalname):
            return True
    return False


def runs_interpreted_triton(item) -> bool:
    """A test instance given a backend that runs Triton kernels under TRITON_INTERPRET=1, or one
    guarded by a `skipif(... reason="needs TRITON_INTERPRET=1")`."""
    params = getattr(item, "callspec", None)
    if params and any(isinstance(v, Backend) and interpreted_triton(v) for v in params.params.values()):
        return True
    return any("TRITON_INTERPRET=1" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))


def markers_for(item) -> list[str]:
    path = item.path.resolve()
    names = []
    if ENGINE_DIR in path.parents:
        names.append("engine")
    if runs_interpreted_triton(item):
        names.append("interpreter")
    if TESTS_DIR in path.parents and is_slow(item, path):
        names.append("slow")
    return names
