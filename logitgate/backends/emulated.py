"""The emulated NPU: the NPU backend's decisions and code paths, run on CPU tensors.

CI has no Ascend device; this backend lets it exercise the float32 host round trip (with dtype
restore), the Ascend launch sizing, the Triton kernels (under TRITON_INTERPRET=1) and the side-stream
protocol (events recorded on the side stream and waited on by the main one).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

from .detect import Probe
from .npu import DEFAULT_VECTOR_CORES, NpuBackend


def probe_emulated_triton() -> Probe:
    """Whether `npu-emulated-triton` can run here: Triton installed and TRITON_INTERPRET=1 (there
    is no NPU nor GPU for Triton to compile for, so its interpreter runs the kernels on the CPU)."""
    if importlib.util.find_spec("triton") is None:
        return Probe(False, "triton is not installed (pip install triton)")
    if os.environ.get("TRITON_INTERPRET") != "1":
        return Probe(False, "TRITON_INTERPRET=1 is not set (Triton's interpreter runs the kernels on the CPU)")
    return Probe(True, "triton-ascend kernels under TRITON_INTERPRET=1, on CPU tensors")


class EmulatedEvent:
    """Stands in for torch.npu.Event: records that it was recorded and waited on."""

    def __init__(self) -> None:
        self.recorded = False
        self.waited = False

    def record(self) -> None:
        self.recorded = True


class EmulatedNpuBackend(NpuBackend):
    """`triton_ascend=True` runs the Triton kernels with Ascend sizing; it needs TRITON_INTERPRET=1
    because there is no NPU (nor GPU) for Triton to compile for."""

    name = "npu-emulated"

    def __init__(
        self,
        *,
        triton_ascend: bool = False,
        torch_compile: bool = False,
        vector_cores: int = DEFAULT_VECTOR_CORES,
    ) -> None:
        if triton_ascend and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("EmulatedNpuBackend(triton_ascend=True) needs TRITON_INTERPRET=1 to run Triton on CPU")
        super().__init__(
            torch.device("cpu"), triton_ascend=triton_ascend, torch_compile=torch_compile, vector_cores=vector_cores
        )
        if triton_ascend:
            self.name = "npu-emulated-triton"  # the device name that selects this variant
        self.side_stream_entries = 0  # how often work was queued on the emulated side stream

    def side_stream(self):
        self.side_stream_entries += 1
        return contextlib.nullcontext()

    def record_event(self) -> EmulatedEvent:
        event = EmulatedEvent()
        event.record()
        return event

    def wait_event(self, event) -> None:
        if event is not None:
            if not event.recorded:
                raise RuntimeError("waited on an event that was never recorded")
            event.waited = True

    def claim_on_current_stream(self, tensor) -> None:
        pass  # CPU tensors: no caching allocator per stream

    def synchronize(self) -> None:
        pass

    def _detect_vector_cores(self) -> int:
        return DEFAULT_VECTOR_CORES
