"""Huawei Ascend NPU backend.

Bitmask application takes the best path the host offers, in this order:
1. triton-ascend: the shared Triton kernel, tiles sized for the 192 KB unified buffer and one
   program per vector core;
2. torch.compile of the torch reference, where torch.compile works on the NPU;
3. otherwise vLLM-Ascend's fallback: copy the selected logit rows to the CPU as float32, mask them
   there with the numba kernel, copy them back in the original dtype (exact for fp16/bf16).
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging

import torch

from .base import Backend, Capabilities
from .cpu.bitmask_kernels import apply_token_bitmask_cpu
from .reference import apply_token_bitmask_reference
from .torch_kernels import apply_top_k_top_p_torch
from .triton.launch import ascend_grid_and_block, ascend_vocab_tile
from .triton.rejection_launch import TritonRejectionMixin
from .triton.tree_launch import TritonTreeMixin

logger = logging.getLogger(__name__)

DEFAULT_VECTOR_CORES = 48  # Atlas A2 (910B): 24 AI cores x 2 vector units
# Bytes a bitmask tile holds per token in the unified buffer: the unpacked int32 bit, the store
# predicate, and the broadcast -inf value (up to 4 bytes).
_BITMASK_BYTES_PER_TOKEN = 4 + 1 + 4

BITMASK_TRITON = "triton-ascend"
BITMASK_COMPILED = "torch.compile"
BITMASK_ROUND_TRIP = "cpu-float32-roundtrip"


class NpuBackend(TritonTreeMixin, TritonRejectionMixin, Backend):
    name = "npu"

    def __init__(
        self,
        device: torch.device | str = "npu",
        *,
        triton_ascend: bool | None = None,
        torch_compile: bool = False,
        vector_cores: int | None = None,
    ) -> None:
        super().__init__(device)
        self._triton_ascend = _detect_triton_ascend() if triton_ascend is None else triton_ascend
        # torch.compile has no NPU code generator in the torch_npu builds logitgate targets.
        self._torch_compile = torch_compile
        self._vector_cores = vector_cores or self._detect_vector_cores()
        self._compiled_reference = None

    # ---- capabilities / report ----

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            native_bitmask=self.bitmask_path != BITMASK_ROUND_TRIP,
            torch_compile=self._torch_compile,
            triton=self._triton_ascend,
            side_streams=True,
            vector_cores=self._vector_cores,
        )

    @property
    def bitmask_path(self) -> str:
        if self._triton_ascend:
            return BITMASK_TRITON
        if self._torch_compile:
            return BITMASK_COMPILED
        return BITMASK_ROUND_TRIP

    def bitmask_tile(self) -> int:
        """Tokens per Triton tile so that one double-buffered tile fits the unified buffer."""
        return ascend_vocab_tile(_BITMASK_BYTES_PER_TOKEN)

    def kernels(self) -> dict[str, str]:
        described = {
            BITMASK_TRITON: f"triton-ascend ({self.bitmask_tile()}-token tiles, grid <= {self._vector_cores} vector cores)",
            BITMASK_COMPILED: "torch.compile of the torch reference",
            BITMASK_ROUND_TRIP: "CPU float32 round trip (numba kernel), dtype restored",
        }
        return {
            **self._rejection_kernel_names(),
            **self._tree_kernel_names(),
            "apply_token_bitmask": described[self.bitmask_path],
            "random_sample": "exponential trick argmax(p / q), q ~ Exp(1) drawn ahead on the side stream, event-synchronised",
            "top_k_top_p": (
                f"triton-ascend bisection over float bits (no sort, grid <= {self._vector_cores} vector cores)"
                if self._triton_ascend
                else "torch.topk candidates when every row has top-k (max k known on the host), else the sort-based reference"
            ),
        }

    def _rejection_uses_triton(self) -> bool:
        return self._triton_ascend

    def _rejection_launch(self, batch_size: int, bytes_per_token: int) -> dict:
        grid, requests_per_program = ascend_grid_and_block(batch_size, self._vector_cores)
        return {"grid": grid, "requests_per_program": requests_per_program, "block_v": ascend_vocab_tile(bytes_per_token)}

    def _tree_uses_triton(self) -> bool:
        return self._triton_ascend

    def _tree_launch(self, bytes_per_token: int) -> dict:
        return {"block": ascend_vocab_tile(bytes_per_token), "max_programs": self._vector_cores}

    # ---- kernels ----

    def apply_token_bitmask(self, logits, bitmask, rows, vocab_size) -> None:
        path = self.bitmask_path
        if path == BITMASK_TRITON:
            self.check_on_device(logits=logits, bitmask=bitmask, rows=rows)
            from .triton.bitmask import apply_token_bitmask_triton

            apply_token_bitmask_triton(
                logits, bitmask, rows, vocab_size, block=self.bitmask_tile(), max_programs=self._vector_cores
            )
        elif path == BITMASK_COMPILED:
            if self._compiled_reference is None:
                self._compiled_reference = torch.compile(apply_token_bitmask_reference, dynamic=True)
            self._compiled_reference(logits, bitmask, rows, vocab_size)
        else:
            self._apply_bitmask_on_host(logits, bitmask, rows, vocab_size)

    def _apply_bitmask_on_host(self, logits, bitmask, rows, vocab_size) -> None:
        selected = logits if rows is None else logits.index_select(0, rows)
        host = selected.to("cpu", torch.float32, copy=True)
        host_mask = (bitmask if rows is None else bitmask.index_select(0, rows)).to("cpu")
        apply_token_bitmask_cpu(host, host_mask, None, vocab_size)
        restored = host.to(logits.device, logits.dtype)
        if rows is None:
            logits.copy_(restored)
        else:
            logits.index_copy_(0, rows, restored)

    def apply_top_k_top_p(self, logits, k, p, max_top_k) -> torch.Tensor:
        if self._triton_ascend:
            self.check_on_device(logits=logits, k=k, p=p)
            from .triton.sampling import BYTES_PER_TOKEN, apply_top_k_top_p_triton

            block = ascend_vocab_tile(BYTES_PER_TOKEN)
            return apply_top_k_top_p_triton(logits, k, p, block=block, max_programs=self._vector_cores)
        return apply_top_k_top_p_torch(logits, k, p, max_top_k)

    # ---- streams ----

    def side_stream(self):
        stream = self._side_stream()
        stream.wait_stream(torch.npu.current_stream())
        return torch.npu.stream(stream)

    def _side_stream(self):
        if not hasattr(self, "_stream"):
            self._stream = torch.npu.Stream()
        return self._stream

    def record_event(self):
        event = torch.npu.Event()
        event.record()
        return event

    def wait_event(self, event) -> None:
        if event is not None:
            torch.npu.current_stream().wait_event(event)

    def claim_on_current_stream(self, tensor) -> None:
        tensor.record_stream(torch.npu.current_stream())

    def synchronize(self) -> None:
        torch.npu.synchronize()

    def _detect_vector_cores(self) -> int:
        if self._triton_ascend:
            with contextlib.suppress(Exception):
                import triton

                props = triton.runtime.driver.active.utils.get_device_properties(torch.npu.current_device())
                cores = int(props.get("num_vectorcore", -1))
                if cores > 0:
                    return cores
        logger.info("vector core count unknown; assuming %d (Atlas A2)", DEFAULT_VECTOR_CORES)
        return DEFAULT_VECTOR_CORES


def _detect_triton_ascend() -> bool:
    """True when the installed triton drives an Ascend NPU (triton-ascend)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton

        return triton.runtime.driver.active.get_current_target().backend in ("npu", "ascend")
    except Exception:  # no driver for this host
        return False
