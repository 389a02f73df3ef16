import os

import pytest
from hypothesis import HealthCheck, settings

from logitgate.backends import clear_backend_cache, get_backend, probe_cuda

settings.register_profile(
    "logitgate",
    deadline=None,
    max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "60")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    # CI runs one fixed set of examples so that a run is reproducible; developers get fresh ones.
    derandomize=os.environ.get("CI", "").lower() in ("1", "true"),
    print_blob=True,
)
settings.load_profile("logitgate")

TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _triton_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def reachable_backends():
    """Every backend this host can run: cpu, the emulated NPU (host round trip), the emulated NPU
    running the Triton kernels under the interpreter, and CUDA where present."""
    from logitgate.backends.emulated import EmulatedNpuBackend

    backends = [get_backend("cpu"), EmulatedNpuBackend()]
    if TRITON_INTERPRET and _triton_installed():
        backends.append(EmulatedNpuBackend(triton_ascend=True, vector_cores=4))
    if probe_cuda().available:
        backends.append(get_backend("cuda"))
    return backends


BACKENDS = reachable_backends()
BACKEND_IDS = [f"{b.name}-{b.kernels()['apply_token_bitmask'].split()[0]}" for b in BACKENDS]


@pytest.fixture(params=BACKENDS, ids=BACKEND_IDS)
def backend(request):
    return request.param


@pytest.fixture(autouse=True)
def _isolate_backend_env(monkeypatch):
    monkeypatch.delenv("LOGITGATE_DEVICE", raising=False)
    yield
    clear_backend_cache()
