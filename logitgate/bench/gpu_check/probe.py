"""The machine the check runs on: device, versions, what could be imported."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
from typing import Any


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_cores": os.cpu_count(),
        "device": device,
    }
    for module in ("triton", "numba", "xgrammar", "hypothesis", "logitgate"):
        try:
            importlib.import_module(module)
            env[module] = importlib.metadata.version(module)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            env[module] = f"unavailable: {type(exc).__name__}: {exc}"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            device_name=torch.cuda.get_device_name(0),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
    else:
        env["device_name"] = f"CPU ({platform.processor() or platform.machine()}), dry run"
    env["triton_interpret"] = os.environ.get("TRITON_INTERPRET") == "1"
    return env
