"""Host/device copies: non-blocking to a device, blocking to the host (a non-blocking copy to the
host returns before the values arrive, and the host reads them next), decided in one place."""
import re
from pathlib import Path

import torch

from logitgate.backends.transfer import to_device

PACKAGE = Path(__file__).resolve().parents[2] / "logitgate"


class _Recorder:
    """Stands in for a tensor on another device: records how it is copied."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.calls: list[dict] = []

    def to(self, **kwargs):
        self.calls.append(kwargs)
        return self


def test_copies_to_the_host_block_and_copies_to_a_device_do_not():
    on_gpu = _Recorder("cuda:0")
    to_device(on_gpu, "cpu")
    to_device(on_gpu, torch.device("cpu"), torch.float32)
    assert [c["non_blocking"] for c in on_gpu.calls] == [False, False]
    assert on_gpu.calls[1]["dtype"] == torch.float32
    on_host = _Recorder("cpu")
    to_device(on_host, "cuda:0")
    to_device(on_host, torch.device("meta"))
    assert [c["non_blocking"] for c in on_host.calls] == [True, True]


def test_a_tensor_already_there_is_returned_as_is():
    t = torch.arange(4)
    assert to_device(t, "cpu") is t
    assert to_device(t, "cpu", torch.float64).dtype == torch.float64


def test_no_other_copy_in_the_package_chooses_non_blocking():
    """A `.to(..., non_blocking=True)` whose destination may be the host is a race on a GPU (the
    GPU check caught TreeLogitsProcessor applying a half-copied bitmask): every copy goes through
    backends/transfer.py."""
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{n}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "transfer.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"non_blocking\s*=", line.split("#")[0])
    ]
    assert offenders == []
