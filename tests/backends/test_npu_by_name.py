"""Choosing the NPU by name (`LOGITGATE_DEVICE=npu`, `--device npu`) with fake torch_npu packages that
behave like the real one: torch only parses "npu" after `import torch_npu` has renamed the
privateuse1 backend, and with TORCH_DEVICE_BACKEND_AUTOLOAD=0 nothing imports it before logitgate.

Registering a device is global to a process and cannot be undone, so every case runs in a fresh
interpreter."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What the real torch_npu does on import that matters here: rename privateuse1 to "npu" and register
# torch.npu. Until it is imported, torch.device("npu") raises.
REGISTERING = """
import types
import torch

torch.utils.rename_privateuse1_backend("npu")
npu = types.ModuleType("torch_npu.npu")
npu.is_available = lambda: {count} > 0
npu.device_count = lambda: {count}
npu.current_device = lambda: 0
torch._register_device_module("npu", npu)
"""
FAKES = {
    "two_npus": REGISTERING.format(count=2),
    "no_npu": REGISTERING.format(count=0),  # CANN found, no device visible (or all taken)
    "no_cann": 'raise OSError("libhccl.so: cannot open shared object file: No such file or directory")',
}


@pytest.fixture
def fake_env(tmp_path):
    def make(kind: str | None, **extra: str) -> dict:
        paths = [ROOT]
        if kind is not None:
            pkg = tmp_path / kind / "torch_npu"
            pkg.mkdir(parents=True)
            (pkg / "__init__.py").write_text(FAKES[kind] + "\n")
            paths.insert(0, str(tmp_path / kind))
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", **extra)
        env.pop("LOGITGATE_DEVICE", None)
        env.update(extra)
        env["PYTHONPATH"] = os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")])
        return env

    return make


# Tries each name; prints {name: backend name and device, or the error}. Checks first that torch
# really cannot parse "npu" before torch_npu is imported (the fake behaves like the real package).
PROBE_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings
    import torch
    try:
        torch.device("npu")
        sys.exit("torch parsed 'npu' before torch_npu was imported: the fake is not realistic")
    except RuntimeError:
        pass
    warnings.simplefilter("ignore")
    from logitgate.backends import get_backend
    out = {}
    for name in sys.argv[1:]:
        try:
            backend = get_backend(None if name == "env" else name)
            out[name] = [backend.name, str(backend.device)]
        except ValueError as exc:
            out[name] = str(exc)
    print(json.dumps(out))
    """
)


def _probe(env: dict, *names: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE_SCRIPT, *names], capture_output=True, text=True, env=env, timeout=180
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_npu_by_name_imports_torch_npu_first(fake_env):
    got = _probe(fake_env("two_npus", LOGITGATE_DEVICE="npu"), "env", "npu", "NPU:1", "npu:2")
    assert got["env"] == ["npu", "npu:0"]
    assert got["npu"] == ["npu", "npu:0"]
    assert got["NPU:1"] == ["npu", "npu:1"]
    assert got["npu:2"] == "device 'npu:2' requested but only 2 NPU(s) are visible"


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("no_npu", "torch_npu imported, but no NPU device is available"),
        ("no_cann", "importing torch_npu failed: OSError: libhccl.so"),
        (None, "torch_npu is not installed"),
    ],
)
def test_unusable_npu_by_name_says_why(fake_env, kind, reason):
    got = _probe(fake_env(kind, LOGITGATE_DEVICE="npu"), "env", "npu:0")
    for name in ("env", "npu:0"):
        assert got[name].startswith("device 'npu:0' requested but the NPU is unusable: " + reason), got[name]
        assert "unknown device" not in got[name]


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "logitgate", *args], capture_output=True, text=True, env=env, timeout=180
    )


def test_doctor_device_npu(fake_env):
    out = _cli(fake_env("two_npus"), "doctor", "--device", "npu")
    assert out.returncode == 0, out.stderr
    assert re.search(r"^\s*npu\s+usable\s+2 device\(s\)", out.stdout, re.M), out.stdout  # columns as wide as the longest name
    assert "selected backend: npu on npu:0" in out.stdout
    assert "CPU float32 round trip" in out.stdout  # no triton-ascend here: the host fallback

    out = _cli(fake_env("no_cann"), "doctor", "--device", "npu")
    assert out.returncode == 1  # the report is printed, and the requested device is unusable
    assert "selected backend: none: device 'npu:0' requested but the NPU is unusable: importing torch_npu " \
        "failed: OSError: libhccl.so" in out.stdout


def test_demo_device_npu_says_why(fake_env):
    out = _cli(fake_env("no_npu"), "demo", "--device", "npu", "--quick")
    assert out.returncode == 2
    assert "logitgate: error: device 'npu:0' requested but the NPU is unusable: torch_npu imported, but no NPU" \
        in out.stderr
