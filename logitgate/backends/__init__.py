"""The device layer. `get_backend()` picks: the argument, then LOGITGATE_DEVICE, then CUDA, then
NPU, then CPU. Backends are cached per device."""
from __future__ import annotations

import re
import threading

import torch

from .. import envs
from .base import Backend, Capabilities
from .detect import Probe, probe_cuda, probe_npu, reset_probes

__all__ = [
    "Backend",
    "Capabilities",
    "DeviceUnavailableError",
    "Probe",
    "backend_for_tensor",
    "clear_backend_cache",
    "get_backend",
    "probe_cuda",
    "probe_npu",
    "reset_probes",
]

ENV_VAR = "LOGITGATE_DEVICE"
DEVICE_KINDS = ("cpu", "cuda", "npu", "npu-emulated", "npu-emulated-triton")
# The emulated NPU running the triton-ascend kernels (Ascend launch sizing) on CPU tensors through
# Triton's interpreter: what an Ascend host with triton-ascend runs, reachable in CPU-only CI.
EMULATED_TRITON = "npu-emulated-triton"

# torch parses "npu" only after torch_npu has registered it (importing torch_npu renames the
# privateuse1 backend), and with TORCH_DEVICE_BACKEND_AUTOLOAD=0 nothing imports it before
# logitgate's probe does: so NPU names are parsed here, and the probe in _build says why it fails.
_NPU_NAME = re.compile(r"npu(?::(\d+))?")

_cache: dict[str, Backend] = {}
_lock = threading.Lock()


class DeviceUnavailableError(ValueError):
    """A device was named correctly but cannot be used on this host; the message says why."""


def _normalize(device: str | torch.device) -> str:
    """A cache key: 'cpu', 'cuda:0', 'npu:0', 'npu-emulated'."""
    if isinstance(device, torch.device):
        text = str(device)
    elif isinstance(device, str):
        text = device.strip().lower()
    else:
        raise ValueError(f"device must be a str, torch.device or Backend, got {type(device).__name__}")
    if text in ("npu-emulated", EMULATED_TRITON):
        return text
    npu = _NPU_NAME.fullmatch(text)
    if npu:
        return f"npu:{int(npu.group(1) or 0)}"
    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICE_KINDS)}") from None
    if parsed.type == "cpu":
        return "cpu"
    if parsed.type not in ("cuda", "npu", "privateuseone"):
        raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICE_KINDS)}")
    kind = "npu" if parsed.type != "cuda" else "cuda"
    return f"{kind}:{parsed.index or 0}"


def _detect() -> str:
    if probe_cuda().available:
        return f"cuda:{torch.cuda.current_device()}"
    if probe_npu().available:
        return f"npu:{torch.npu.current_device()}"
    return "cpu"


def _build(key: str) -> Backend:
    if key == "cpu":
        from .cpu import CpuBackend  # numba loads here, not when a GPU backend's kernels do

        return CpuBackend()
    if key == "npu-emulated":
        from .emulated import EmulatedNpuBackend

        return EmulatedNpuBackend()
    if key == EMULATED_TRITON:
        from .emulated import EmulatedNpuBackend, probe_emulated_triton

        probe = probe_emulated_triton()
        if not probe.available:
            raise DeviceUnavailableError(f"device {key!r} requested but {probe.reason}")
        return EmulatedNpuBackend(triton_ascend=True)
    kind, index = key.split(":")
    if kind == "cuda":
        probe = probe_cuda()
        if not probe.available:
            raise DeviceUnavailableError(f"device {key!r} requested but CUDA is unusable: {probe.reason}")
        if int(index) >= probe.count:
            raise DeviceUnavailableError(
                f"device {key!r} requested but only {probe.count} CUDA device(s) are visible"
            )
        from .cuda import CudaBackend

        return CudaBackend(torch.device("cuda", int(index)))
    probe = probe_npu()
    if not probe.available:
        raise DeviceUnavailableError(f"device {key!r} requested but the NPU is unusable: {probe.reason}")
    if int(index) >= probe.count:
        raise DeviceUnavailableError(f"device {key!r} requested but only {probe.count} NPU(s) are visible")
    from .npu import NpuBackend

    return NpuBackend(f"npu:{index}")


def get_backend(device: str | torch.device | Backend | None = None) -> Backend:
    """The backend for `device`; None means LOGITGATE_DEVICE, else the best device found here."""
    if isinstance(device, Backend):
        return device
    if device is None:
        env = (envs.read(ENV_VAR) or "").strip()
        key = _normalize(env) if env else _detect()
    else:
        key = _normalize(device)
    with _lock:
        backend = _cache.get(key)
        if backend is None:
            backend = _cache[key] = _build(key)
    return backend


def backend_for_tensor(tensor: torch.Tensor, backend: str | torch.device | Backend | None = None) -> Backend:
    """The backend that operates on `tensor`: the one given (which must match the tensor's device),
    else LOGITGATE_DEVICE when it names the tensor's device type (so npu-emulated takes CPU tensors),
    else the backend of the tensor's own device."""
    if backend is not None:
        chosen = get_backend(backend)
        if chosen.device.type != tensor.device.type:
            raise ValueError(f"tensor is on {tensor.device} but backend {chosen.name!r} runs on {chosen.device}")
        return chosen
    env = (envs.read(ENV_VAR) or "").strip()
    if env:
        chosen = get_backend(env)
        if chosen.device.type == tensor.device.type:
            return chosen
    return get_backend(tensor.device)


def clear_backend_cache() -> None:
    with _lock:
        _cache.clear()
