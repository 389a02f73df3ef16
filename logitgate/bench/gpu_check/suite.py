"""The test suite on the device (native Triton, LOGITGATE_DEVICE set) and its junit counts."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from .config import REPO


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and the failing tests (with the first line of their message) of a pytest junit XML."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is not None:
                message = (node.get("message") or node.text or "").strip().splitlines()
                failed.append(f"{case.get('classname')}::{case.get('name')} ({kind}): {message[0][:200] if message else ''}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed}


def run_tests(device: str, pytest_args: list[str], out: Path, timeout_s: float) -> dict[str, Any]:
    env = dict(os.environ, LOGITGATE_DEVICE=device, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env.pop("TRITON_INTERPRET", None)  # native Triton
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH"), env.get("LOGITGATE_GPU_SITE")) if p)
    junit = out / "pytest.xml"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={junit}", *pytest_args]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        log, status = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        log = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        status = "timeout"
    (out / "pytest.log").write_text(log)
    result: dict[str, Any] = {"command": shlex.join(cmd), "exit": status, "seconds": round(time.perf_counter() - start, 1),
                              "log": str(out / "pytest.log")}
    if junit.is_file():
        result.update(parse_junit(junit))
    result["passed_all"] = status == 0
    if status == "timeout":
        result["note"] = f"pytest ran past the {timeout_s:.0f} s left of the budget"
    return result
