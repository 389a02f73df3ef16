import os

import pytest
from hypothesis import HealthCheck, settings

from logitgate.backends import clear_backend_cache, get_backend, probe_cuda
from tests.helpers.markers import markers_for

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


# The device the session was started for (`LOGITGATE_DEVICE=cuda make gpu-check`). Read once here:
# each test runs with the variable cleared (see _isolate_backend_env) and selects backends itself.
SESSION_DEVICE = os.environ.get("LOGITGATE_DEVICE")


def reachable_backends():
    """Every backend this host can run: cpu, the emulated NPU (host round trip), the emulated NPU
    running the Triton kernels under the interpreter, and CUDA where present. With
    LOGITGATE_DEVICE=cuda, CUDA must be usable: a GPU run never passes silently on the CPU alone."""
    from logitgate.backends.emulated import EmulatedNpuBackend

    backends = [get_backend("cpu"), EmulatedNpuBackend()]
    if TRITON_INTERPRET and _triton_installed():  # by name, as an Ascend user's CI selects it
        backends.append(get_backend("npu-emulated-triton"))
    cuda = probe_cuda()
    if SESSION_DEVICE == "cuda" and not cuda.available:
        raise pytest.UsageError(f"LOGITGATE_DEVICE=cuda but CUDA is unusable: {cuda.reason}")
    if cuda.available:
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


def pytest_collection_modifyitems(config, items):
    """The `engine`, `interpreter` and `slow` markers (pyproject.toml), by where a test is and
    what it runs: tests/helpers/markers.py."""
    for item in items:
        for name in markers_for(item):
            item.add_marker(name)


def _cuda_variant_fixture(op: str):
    """A fixture running a `backend` test once per CUDA kernel variant of `op`
    (LOGITGATE_CUDA_KERNELS): every variant on CUDA, `current` alone on the other backends."""

    @pytest.fixture(params=["current", "v2"])
    def fixture(request, backend, monkeypatch):
        from tests.helpers.cuda_variants import skip_unless_cuda_variant

        skip_unless_cuda_variant(backend, request.param)
        monkeypatch.setenv("LOGITGATE_CUDA_KERNELS", f"{op}={request.param}")
        return request.param

    return fixture


sampling_variant = _cuda_variant_fixture("sampling")
rejection_variant = _cuda_variant_fixture("rejection")
