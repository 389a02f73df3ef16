"""`make gpu-wheels` carries every package xgrammar and hypothesis import on the GPU machines
(Python 3.12, Linux x86_64), except what those machines have preinstalled (torch, triton, numpy),
at the versions installed here: a new dependency or version cannot silently break the offline run.
The list is requirements/tested-pins.txt, which also constrains the .venv install, so a new upstream
release cannot make the two differ."""
import importlib.metadata
import re
from pathlib import Path

import pytest

from tests.helpers.environment import logitgate_installed

packaging_requirements = pytest.importorskip("packaging.requirements")

PINS = Path(__file__).resolve().parents[2] / "requirements" / "tested-pins.txt"
PREINSTALLED = {"torch", "triton", "numpy"}
GPU_HOST = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux", "platform_system": "Linux",
            "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython", "extra": ""}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listed_wheels() -> dict[str, str]:
    lines = [line.strip() for line in PINS.read_text().splitlines()]
    pins = [line for line in lines if line and not line.startswith("#")]
    return dict((canonical(n), v) for n, v in (pin.split("==") for pin in pins))


def closure(roots: list[str]) -> set[str]:
    seen, stack = set(), list(roots)
    while stack:
        name = canonical(stack.pop())
        if name in seen or name in PREINSTALLED:
            continue
        seen.add(name)
        for text in importlib.metadata.requires(name) or []:
            req = packaging_requirements.Requirement(text)
            if req.marker is None or req.marker.evaluate(GPU_HOST):
                stack.append(req.name)
    return seen


def test_wheel_list_covers_what_xgrammar_and_hypothesis_import():
    pytest.importorskip("xgrammar")
    listed = listed_wheels()
    needed = closure(["xgrammar", "hypothesis"])
    if not logitgate_installed():
        # A checkout run on a machine's own packages (the GPU check): what they import at their
        # versions says nothing about the pinned ones. `make test`'s .venv is installed from the pins.
        other = sorted(f"{n} {importlib.metadata.version(n)} (pinned {listed.get(n, 'not pinned')})"
                       for n in needed if listed.get(n) != importlib.metadata.version(n))
        pytest.skip("logitgate is not installed here with tested-pins.txt as constraints; this machine's packages: "
                    + (", ".join(other) or "as pinned"))
    assert needed - set(listed) == set(), "add these to requirements/tested-pins.txt"
    for name in needed:
        assert listed[name] == importlib.metadata.version(name), f"tested-pins.txt pins {name}=={listed[name]}, tested with another"
