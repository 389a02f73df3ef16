"""Copies between the host and a device, with the one rule on blocking.

A copy to a device is queued on the current stream without blocking the host: from pageable host
memory the host waits only until its values are staged, and pinned memory is kept alive by the
caching host allocator until the copy has run. A copy to the host blocks until the values are
there: the host reads them next, and a non-blocking device-to-host copy returns before they have
arrived (the host then reads whatever the destination held: the GPU check caught a tree on CUDA
constraining CPU logits with a half-copied bitmask). Every host/device copy in logitgate goes
through `to_device`, so no call site decides this for itself (tests/backends/test_transfer.py).
"""
from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`tensor` on `device` (and as `dtype` when given): the tensor itself when it is already
    there, else a copy that is non-blocking unless it lands on the host."""
    device = torch.device(device)
    return tensor.to(device=device, dtype=dtype, non_blocking=device.type != "cpu")
