"""CUDA backend: Triton kernels, side streams for work queued ahead of the decode step."""
from __future__ import annotations

import importlib.util

import torch

from .base import NOISE_EXPONENTIAL, NOISE_PHILOX, Backend, Capabilities, SamplingNoise
from .reference import apply_token_bitmask_reference
from .sampling_rules import draw_seeds
from .torch_kernels import apply_top_k_top_p_torch
from .triton.rejection_launch import TritonRejectionMixin
from .triton.tree_launch import TritonTreeMixin
from .variants import cuda_variant

CUDA_BITMASK_BLOCK = 4096
CUDA_REJECTION_BLOCK = 4096  # vocabulary tile of the per-request rejection kernels
CUDA_TREE_BLOCK = 1024  # candidates (or bitmask words, or -inf columns) per tree-kernel tile
CUDA_TOP_K_TOP_P_BLOCK = 4096
# One program per row: below this many rows the bisection kernel leaves the GPU mostly idle and a
# segmented sort of a few rows is cheap anyway.
CUDA_TOP_K_TOP_P_MIN_ROWS = 8
# v2 sampling: the largest max(top_k) the one-read top-k sampler takes (each vocabulary chunk keeps
# that many candidates; the per-row merge holds chunks x candidates in registers).
CUDA_SAMPLE_MAX_TOP_K = 256
CUDA_SAMPLE_CHUNK = 8192  # vocabulary tokens per program of the v2 sampling kernels


class CudaBackend(TritonTreeMixin, TritonRejectionMixin, Backend):
    name = "cuda"

    def __init__(self, device: torch.device | str = "cuda") -> None:
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device)
        self._has_triton = importlib.util.find_spec("triton") is not None
        self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._stream = torch.cuda.Stream(device=device)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(native_bitmask=True, torch_compile=True, triton=self._has_triton, side_streams=True)

    def kernels(self) -> dict[str, str]:
        if not self._has_triton:
            bitmask = "torch reference (triton missing)"
        elif cuda_variant("bitmask") == "v2":
            bitmask = "triton v2 (a tile per program, per-lane bits, load-select-store)"
        else:
            bitmask = "triton (grid-stride, int view store)"
        return {
            **self._rejection_kernel_names(),
            **self._rejection_v2_kernel_names(),
            **self._tree_kernel_names(),
            "apply_token_bitmask": bitmask,
            "random_sample": "exponential trick argmax(p / q), q ~ Exp(1) drawn ahead on a side stream, event-synchronised",
            "top_k_top_p": "torch.topk candidates when every row has top-k (max k known on the host); else, from "
            f"{CUDA_TOP_K_TOP_P_MIN_ROWS} rows, the Triton bisection kernel (no sort); else the sort-based reference",
            **self._sampling_v2_kernel_names(),
        }

    def _rejection_v2_kernel_names(self) -> dict[str, str]:
        if not self._rejection_v2():
            return {}
        return {
            "rejection_verify": "triton v2: (row, chunk) statistics in one read, greedy and random requests accepted "
            "in one per-request pass, recovery races over the rejected rows only with Philox noise in the kernel, "
            "the output written by the last kernel",
            "rejection_recover": "triton v2: (request, chunk) races with Philox noise in the kernel (rejected rows only)",
        }

    def _sampling_v2(self) -> bool:
        return self._has_triton and cuda_variant("sampling") == "v2"

    def _sampling_v2_kernel_names(self) -> dict[str, str]:
        if not self._sampling_v2():
            return {}
        return {
            "random_sample": "triton v2: race argmax(p / q) over (row, chunk) programs, q from a per-row Philox seed "
            "in the kernel, rows without a total given their fallback in the same pass",
            "sample_from_logits": f"triton v2: temperature, top-k (max k <= {CUDA_SAMPLE_MAX_TOP_K} known on the host), "
            "top-p and the draw in two kernels that read the logits once",
        }

    @property
    def fused_logit_sampling(self) -> bool:
        return self._sampling_v2()

    @property
    def sampling_noise_kind(self) -> str:
        return NOISE_PHILOX if self._sampling_v2() else NOISE_EXPONENTIAL

    def draw_sampling_noise(self, batch_size, vocab_size, generators) -> SamplingNoise:
        if not self._sampling_v2():
            return super().draw_sampling_noise(batch_size, vocab_size, generators)
        with self.side_stream():
            seeds = draw_seeds(batch_size, generators, self.device)
            event = self.record_event()
        return SamplingNoise(NOISE_PHILOX, seeds, event)

    def _seeds(self, batch_size, generators, noise) -> torch.Tensor:
        """This call's per-row seeds: the prefetched ones (waited for on the device), or drawn now."""
        if noise is None:
            return draw_seeds(batch_size, generators, self.device)
        self.wait_event(noise.event)
        self.claim_on_current_stream(noise.values)
        return noise.values

    def random_sample(self, probs, generators, noise) -> torch.Tensor:
        if not self._sampling_v2():
            return super().random_sample(probs, generators, noise)
        self.check_on_device(probs=probs)
        from .triton.sampling_v2 import random_sample_v2

        return random_sample_v2(probs, self._seeds(probs.shape[0], generators, noise), chunk=CUDA_SAMPLE_CHUNK)

    def sample_from_logits(self, logits, temperature, k, p, max_top_k, generators, noise):
        if not (self._sampling_v2() and k is not None and max_top_k is not None
                and 0 < max_top_k < logits.shape[-1] and max_top_k <= CUDA_SAMPLE_MAX_TOP_K):
            return None
        self.check_on_device(logits=logits, temperature=temperature, k=k, p=p)
        from .triton.sampling_v2 import top_k_top_p_sample_v2

        seeds = self._seeds(logits.shape[0], generators, noise)
        return top_k_top_p_sample_v2(logits, temperature, k, p, max_top_k, seeds, chunk=CUDA_SAMPLE_CHUNK)

    def _rejection_uses_triton(self) -> bool:
        return self._has_triton

    def _rejection_v2(self) -> bool:
        return self._has_triton and cuda_variant("rejection") == "v2"

    @property
    def recovery_noise(self) -> str:
        return NOISE_PHILOX if self._rejection_v2() else NOISE_EXPONENTIAL

    def rejection_verify(self, cu_num_draft_tokens, token_request, draft_token_ids, target_logits, temperature,
                         draft_probs, uniform, noise, bonus, width, all_greedy):
        if not self._rejection_v2():
            return None
        self.check_on_device(
            cu_num_draft_tokens=cu_num_draft_tokens, token_request=token_request, draft_token_ids=draft_token_ids,
            target_logits=target_logits, temperature=temperature, draft_probs=draft_probs, uniform=uniform, noise=noise,
            bonus=bonus,
        )
        from .triton.rejection_v2 import verify_v2

        return verify_v2(cu_num_draft_tokens, token_request, draft_token_ids, target_logits, temperature, draft_probs,
                         uniform, noise, bonus, width, all_greedy=all_greedy, chunk=CUDA_SAMPLE_CHUNK)

    def rejection_recover(self, cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs,
                          accepted, row_lse, noise, active):
        if not self._rejection_v2():
            return super().rejection_recover(cu_num_draft_tokens, draft_token_ids, target_logits, temperature,
                                             draft_probs, accepted, row_lse, noise, active)
        self.check_on_device(
            cu_num_draft_tokens=cu_num_draft_tokens, draft_token_ids=draft_token_ids, target_logits=target_logits,
            temperature=temperature, draft_probs=draft_probs, accepted=accepted, row_lse=row_lse, noise=noise, active=active,
        )
        from .triton.rejection_v2 import recover_v2

        return recover_v2(cu_num_draft_tokens, draft_token_ids, target_logits, temperature, draft_probs, accepted,
                          row_lse, noise, active, chunk=CUDA_SAMPLE_CHUNK)

    def _rejection_launch(self, batch_size: int, bytes_per_token: int) -> dict:
        # One program per request: enough parallelism for decode batches, and every row is read
        # by one program only while its request is still accepting.
        return {"grid": max(batch_size, 1), "requests_per_program": 1, "block_v": CUDA_REJECTION_BLOCK}

    def _tree_uses_triton(self) -> bool:
        return self._has_triton

    def _tree_launch(self, bytes_per_token: int) -> dict:
        # Grid-stride over (row, tile) work items with a few programs per SM, as the bitmask kernel.
        return {"block": CUDA_TREE_BLOCK, "max_programs": self._num_sms * 4}

    def apply_token_bitmask(self, logits, bitmask, rows, vocab_size) -> None:
        if not self._has_triton:
            apply_token_bitmask_reference(logits, bitmask, rows, vocab_size)
            return
        self.check_on_device(logits=logits, bitmask=bitmask, rows=rows)
        if cuda_variant("bitmask") == "v2":
            from .triton.bitmask import apply_token_bitmask_tiles_triton

            apply_token_bitmask_tiles_triton(logits, bitmask, rows, vocab_size)
            return
        from .triton.bitmask import apply_token_bitmask_triton

        apply_token_bitmask_triton(
            logits, bitmask, rows, vocab_size, block=CUDA_BITMASK_BLOCK, max_programs=self._num_sms * 4
        )

    def apply_top_k_top_p(self, logits, k, p, max_top_k) -> torch.Tensor:
        topk_path = k is not None and max_top_k is not None and max_top_k < logits.shape[-1]
        if self._has_triton and not topk_path and logits.shape[0] >= CUDA_TOP_K_TOP_P_MIN_ROWS:
            self.check_on_device(logits=logits, k=k, p=p)
            from .triton.sampling import apply_top_k_top_p_triton

            return apply_top_k_top_p_triton(logits, k, p, block=CUDA_TOP_K_TOP_P_BLOCK, max_programs=logits.shape[0])
        return apply_top_k_top_p_torch(logits, k, p, max_top_k)

    def side_stream(self):
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._stream)

    def record_event(self):
        event = torch.cuda.Event()
        event.record()
        return event

    def wait_event(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def claim_on_current_stream(self, tensor) -> None:
        tensor.record_stream(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
