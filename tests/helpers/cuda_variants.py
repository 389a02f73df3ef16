"""The CUDA backend's kernel variants (LOGITGATE_CUDA_KERNELS) in tests.

`interpreted_cuda_backend()` is the CUDA backend's own dispatch (its variant choice, launch sizes and
glue) on CPU tensors, its Triton kernels run by TRITON_INTERPRET=1: the one way to check the CUDA
kernels against the reference on a host without a GPU. `variant_backends(backend)` pairs each test
with the variants worth running on it: every variant on CUDA (real or interpreted), `current`
alone elsewhere (the variable only affects CUDA)."""
from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest
import torch

from logitgate.backends.base import Backend
from logitgate.backends.cuda import CudaBackend
from logitgate.backends.variants import VARIANTS, selected

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1")


class InterpretedCudaBackend(CudaBackend):
    """CudaBackend on CPU tensors: no streams (work runs in order), 4 'SMs'."""

    name = "cuda-interpreted"

    def __init__(self, num_sms: int = 4) -> None:
        Backend.__init__(self, torch.device("cpu"))
        self._has_triton = True
        self._num_sms = num_sms

    def side_stream(self):
        return contextlib.nullcontext()

    def record_event(self):
        return None

    def wait_event(self, event) -> None:
        pass

    def claim_on_current_stream(self, tensor) -> None:
        pass

    def synchronize(self) -> None:
        pass


def interpreted_cuda_backend() -> InterpretedCudaBackend:
    return InterpretedCudaBackend()


def interpreted_v2_fixture(op: str, chunk: int = 32):
    """A fixture: the interpreted CUDA backend with `op` on v2 and `chunk`-token vocabulary chunks in
    the v2 kernels (several per row at test sizes, so the chunk merges are exercised)."""

    @pytest.fixture
    def fixture(monkeypatch):
        from logitgate.backends import cuda as cuda_module

        monkeypatch.setenv("LOGITGATE_CUDA_KERNELS", f"{op}=v2")
        monkeypatch.setattr(cuda_module, "CUDA_SAMPLE_CHUNK", chunk)
        return interpreted_cuda_backend()

    return fixture


def skip_unless_cuda_variant(backend, name: str) -> None:
    """Variants other than `current` only change CUDA: skip them for other backends."""
    if name != "current" and not isinstance(backend, CudaBackend):
        pytest.skip("LOGITGATE_CUDA_KERNELS only affects the CUDA backend")


__all__ = ["VARIANTS", "InterpretedCudaBackend", "interpreted_cuda_backend", "interpreted_v2_fixture", "needs_interpreter", "selected", "skip_unless_cuda_variant"]
