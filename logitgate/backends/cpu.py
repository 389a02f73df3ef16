"""CPU backend: numba kernels, parallel over rows and vocabulary chunks."""
from __future__ import annotations

import torch

from .base import Backend, Capabilities
from .cpu_kernels import apply_token_bitmask_cpu


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(native_bitmask=True, torch_compile=True, triton=False, side_streams=False)

    def kernels(self) -> dict[str, str]:
        return {
            "apply_token_bitmask": "numba (one masked vector store per word, -1 words skipped; "
            "parallel over rows x 4096-token chunks, serial up to 131k tokens)"
        }

    def apply_token_bitmask(self, logits, bitmask, rows, vocab_size) -> None:
        apply_token_bitmask_cpu(logits, bitmask, rows, vocab_size)
