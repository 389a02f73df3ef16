"""Packages the GPU machines lack (no network there), installed from a folder of wheels."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from .config import REPO

# Modules the check needs that the GPU machines may lack -> the pip names to install from the wheels.
NEEDED = {"xgrammar": "xgrammar", "hypothesis": "hypothesis"}
DEFAULT_WHEELS = REPO / ".gpu-wheels"


def ensure_packages(wheels: str | Path, needed: dict[str, str] = NEEDED, site: Path | None = None) -> dict[str, str]:
    """module -> "present" | "installed from <wheels>..." | "missing: <why>". Installs the missing ones
    from `wheels` only (no network on the GPU machines): into the interpreter's environment with
    pip --no-index; where that is refused (a read-only or externally managed Python), every wheel
    with --no-deps --target `site` (.gpu-site/ next to the checkout), appended to sys.path and to the
    tests' PYTHONPATH, so the machine's own packages (torch, triton) still come first."""
    site = site or REPO / ".gpu-site"
    status = {m: "present" for m in needed if importlib.util.find_spec(m) is not None}
    missing = [m for m in needed if m not in status]
    if not missing:
        return status
    wheels = Path(wheels)
    wheel_files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not wheel_files:
        for m in missing:
            status[m] = f"missing: no wheels in {wheels} (run `make gpu-wheels` on a machine with network)"
        return status
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index"]
    proc = subprocess.run([*pip, "--find-links", str(wheels), *(needed[m] for m in missing)], capture_output=True, text=True)
    how = f"installed from {wheels}"
    if proc.returncode != 0:
        proc = subprocess.run([*pip, "--no-deps", "--target", str(site), *map(str, wheel_files)], capture_output=True, text=True)
        how = f"installed from {wheels} into {site}"
        if proc.returncode == 0:
            add_site(site)
    importlib.invalidate_caches()
    for m in missing:
        if proc.returncode == 0 and importlib.util.find_spec(m) is not None:
            status[m] = how
        else:
            tail = (proc.stderr.strip().splitlines() or [f"pip exit {proc.returncode}"])[-1]
            status[m] = f"missing: pip install failed: {tail}"
    return status


def add_site(site: Path) -> None:
    """Make packages installed into `site` importable here and in the test run, after the machine's own."""
    if str(site) not in sys.path:
        sys.path.append(str(site))
    os.environ["LOGITGATE_GPU_SITE"] = str(site)
