"""CUDA backend: Triton kernels, side streams for work queued ahead of the decode step."""
from __future__ import annotations

import importlib.util

import torch

from .base import Backend, Capabilities
from .reference import apply_token_bitmask_reference
from .triton_rejection import TritonRejectionMixin

CUDA_BITMASK_BLOCK = 4096
CUDA_REJECTION_BLOCK = 4096  # vocabulary tile of the per-request rejection kernels


class CudaBackend(TritonRejectionMixin, Backend):
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
        bitmask = "triton (grid-stride, int view store)" if self._has_triton else "torch reference (triton missing)"
        return {"apply_token_bitmask": bitmask, **self._rejection_kernel_names()}

    def _rejection_uses_triton(self) -> bool:
        return self._has_triton

    def _rejection_launch(self, batch_size: int, bytes_per_token: int) -> dict:
        # One program per request: enough parallelism for decode batches, and every row is read
        # by one program only while its request is still accepting.
        return {"grid": max(batch_size, 1), "requests_per_program": 1, "block_v": CUDA_REJECTION_BLOCK}

    def apply_token_bitmask(self, logits, bitmask, rows, vocab_size) -> None:
        if not self._has_triton:
            apply_token_bitmask_reference(logits, bitmask, rows, vocab_size)
            return
        from .triton.bitmask import apply_token_bitmask_triton

        apply_token_bitmask_triton(
            logits, bitmask, rows, vocab_size, block=CUDA_BITMASK_BLOCK, max_programs=self._num_sms * 4
        )

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

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
