"""`logitgate doctor`: versions, devices, why a device is unusable, and which kernel each op uses."""
from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any

import torch

from ..backends import ENV_VAR, get_backend, probe_cuda, probe_npu

PACKAGES = ("torch", "numpy", "numba", "triton", "torch_npu", "xgrammar", "transformers")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report(device: str | None = None) -> dict[str, Any]:
    cuda, npu = probe_cuda(), probe_npu()
    backend = get_backend(device)
    return {
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in PACKAGES},
        "env": {k: os.environ.get(k, "") for k in (ENV_VAR, "TRITON_INTERPRET", "TORCH_DEVICE_BACKEND_AUTOLOAD")},
        "devices": {
            "cpu": {"available": True, "reason": f"{torch.get_num_threads()} torch threads"},
            "cuda": {"available": cuda.available, "reason": cuda.reason},
            "npu": {"available": npu.available, "reason": npu.reason},
        },
        "backend": {"name": backend.name, "device": str(backend.device), "capabilities": backend.capabilities.as_dict()},
        "kernels": backend.kernels(),
    }


def format_report(data: dict[str, Any]) -> str:
    lines = [f"logitgate doctor (python {data['python']})", "", "versions:"]
    lines += [f"  {name:<13} {ver}" for name, ver in data["versions"].items()]
    lines += ["", "environment:"]
    lines += [f"  {k}={v or '(unset)'}" for k, v in data["env"].items()]
    lines += ["", "devices:"]
    for name, dev in data["devices"].items():
        lines.append(f"  {name:<5} {'usable  ' if dev['available'] else 'unusable'}  {dev['reason']}")
    b = data["backend"]
    lines += ["", f"selected backend: {b['name']} on {b['device']}"]
    lines += [f"  {k}: {v}" for k, v in b["capabilities"].items()]
    lines += ["", "kernels:"]
    lines += [f"  {op:<22} {kernel}" for op, kernel in data["kernels"].items()]
    return "\n".join(lines)
