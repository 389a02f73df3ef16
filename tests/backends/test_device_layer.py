"""Backend selection, NPU detection on hosts without CANN, capabilities and the emulated NPU paths."""
import os
import subprocess
import sys

import pytest
import torch

import logitgate
from logitgate.backends import backend_for_tensor, clear_backend_cache, get_backend, probe_cuda, probe_npu, reset_probes
from logitgate.backends.emulated import EmulatedEvent, EmulatedNpuBackend
from logitgate.backends.npu import BITMASK_ROUND_TRIP, BITMASK_TRITON
from logitgate.backends.reference import apply_token_bitmask_reference, pack_bitmask
from logitgate.backends.triton.launch import ASCEND_UB_BYTES, ascend_grid_and_block, ascend_vocab_tile


def test_explicit_env_and_detected_selection(monkeypatch):
    assert get_backend("cpu").name == "cpu"
    assert get_backend("cpu") is get_backend(torch.device("cpu"))  # cached per device
    monkeypatch.setenv("LOGITGATE_DEVICE", "npu-emulated")
    assert get_backend().name == "npu-emulated"
    assert get_backend("cpu").name == "cpu"  # the argument wins over the environment
    monkeypatch.delenv("LOGITGATE_DEVICE")
    # Detection: CUDA where it is usable (the GPU check's hosts), else CPU (no NPU in CI).
    assert get_backend().name == ("cuda" if probe_cuda().available else "cpu")


def test_unknown_and_unusable_devices_are_clear(monkeypatch):
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        get_backend("tpu")
    monkeypatch.setenv("LOGITGATE_DEVICE", "gpu0")
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        get_backend()
    monkeypatch.delenv("LOGITGATE_DEVICE")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is unusable"):
            get_backend("cuda")


def test_env_backend_applies_to_matching_tensors(monkeypatch):
    monkeypatch.setenv("LOGITGATE_DEVICE", "npu-emulated")
    assert backend_for_tensor(torch.zeros(1)).name == "npu-emulated"
    with pytest.raises(ValueError, match="tensor is on meta"):
        backend_for_tensor(torch.zeros(1, device="meta"), "cpu")


FAKE_TORCH_NPU = {
    "oserror": 'raise OSError("libhccl.so: cannot open shared object file: No such file or directory")',
    "importerror": 'raise ImportError("libascendcl.so: cannot open shared object file")',
    "sysexit": "import sys\nsys.exit(1)",
}


@pytest.fixture
def fake_torch_npu(tmp_path, monkeypatch):
    def install(kind):
        pkg = tmp_path / kind / "torch_npu"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(FAKE_TORCH_NPU[kind] + "\n")
        monkeypatch.syspath_prepend(str(tmp_path / kind))
        reset_probes()
        clear_backend_cache()
        return str(tmp_path / kind)

    yield install
    sys.modules.pop("torch_npu", None)
    reset_probes()


@pytest.mark.parametrize("kind", sorted(FAKE_TORCH_NPU))
def test_broken_torch_npu_falls_back_with_one_warning(fake_torch_npu, kind, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no CUDA either (also on a GPU host)
    fake_torch_npu(kind)
    with pytest.warns(RuntimeWarning, match="NPU unusable") as record:
        probe = probe_npu()
        probe_npu()  # cached: no second warning
    assert len(record) == 1
    assert not probe.available
    assert "importing torch_npu failed" in probe.reason
    assert get_backend().name == "cpu"


def test_doctor_shows_why_npu_is_unusable(fake_torch_npu):
    path = fake_torch_npu("oserror")
    env = dict(os.environ, PYTHONPATH=path + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["CUDA_VISIBLE_DEVICES"] = ""  # no CUDA either (also on a GPU host): the fallback is the CPU
    out = subprocess.run(
        [sys.executable, "-m", "logitgate", "doctor"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "libhccl.so" in out.stdout
    assert "selected backend: cpu" in out.stdout
    assert "apply_token_bitmask" in out.stdout


def test_capabilities_declare_the_paths():
    cpu = get_backend("cpu").capabilities
    assert cpu.native_bitmask and not cpu.side_streams and cpu.vector_cores is None
    emulated = EmulatedNpuBackend()
    assert emulated.bitmask_path == BITMASK_ROUND_TRIP
    assert not emulated.capabilities.native_bitmask and emulated.capabilities.side_streams
    assert emulated.capabilities.vector_cores == 48
    assert "round trip" in emulated.kernels()["apply_token_bitmask"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_emulated_triton_ascend_path_is_native():
    emulated = EmulatedNpuBackend(triton_ascend=True, vector_cores=8)
    assert emulated.bitmask_path == BITMASK_TRITON and emulated.capabilities.native_bitmask


def test_triton_ascend_emulation_requires_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        EmulatedNpuBackend(triton_ascend=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_trip_restores_dtype_and_touches_only_selected_rows(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 300, generator=g) * 3).to(dtype)
    bitmask = pack_bitmask(torch.rand(5, 300, generator=g) < 0.5)
    expected = logits.clone()
    apply_token_bitmask_reference(expected, bitmask, torch.tensor([0, 4]), 300)
    got = logits.clone()
    logitgate.apply_token_bitmask_inplace(got, bitmask, indices=[0, 4], backend=EmulatedNpuBackend())
    assert got.dtype == dtype and torch.equal(got, expected)


def test_ascend_launch_sizing_fits_the_unified_buffer():
    assert ascend_grid_and_block(10, 48) == (10, 1)
    assert ascend_grid_and_block(48, 48) == (48, 1)
    assert ascend_grid_and_block(100, 48) == (48, 4)  # ceil(100/48)=3 -> 4
    assert ascend_grid_and_block(1024, 40) == (40, 32)
    tile = EmulatedNpuBackend().bitmask_tile()
    assert tile & (tile - 1) == 0 and 2 * tile * (4 + 1 + 4) <= ASCEND_UB_BYTES
    assert ascend_vocab_tile(1) == 16384 and ascend_vocab_tile(10**6) == 1024


def test_emulated_side_stream_protocol():
    emulated = EmulatedNpuBackend()
    with emulated.side_stream():
        event = emulated.record_event()
    emulated.wait_event(event)
    assert emulated.side_stream_entries == 1 and event.waited
    with pytest.raises(RuntimeError, match="never recorded"):
        emulated.wait_event(EmulatedEvent())


def test_cli_rejects_unknown_device():
    from logitgate.cli import main

    assert main(["doctor", "--device", "tpu"]) == 2


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs TRITON_INTERPRET=1 from the start: Triton picks interpreter or compiler as it defines the kernels",
)
def test_npu_emulated_triton_is_selectable_by_name(monkeypatch):
    """`LOGITGATE_DEVICE=npu-emulated-triton` (or --device) runs the triton-ascend kernels on CPU
    tensors under TRITON_INTERPRET=1, as an Ascend host with triton-ascend would; doctor shows it."""
    pytest.importorskip("triton")
    from logitgate.cli.doctor import format_report, report

    monkeypatch.setenv("LOGITGATE_DEVICE", "npu-emulated-triton")
    backend = backend_for_tensor(torch.zeros(1))
    assert backend.name == "npu-emulated-triton" and backend.bitmask_path == BITMASK_TRITON
    assert backend.capabilities.triton and backend.kernels()["apply_token_bitmask"].startswith("triton-ascend")
    logits = torch.randn(3, 100)
    bitmask = pack_bitmask(torch.rand(3, 100) < 0.3)
    got = logits.clone()
    logitgate.apply_token_bitmask_inplace(got, bitmask)  # picked from LOGITGATE_DEVICE
    apply_token_bitmask_reference(logits, bitmask, None, 100)
    assert torch.equal(got, logits)
    data = report()
    assert data["backend"]["name"] == "npu-emulated-triton" and data["devices"]["npu-emulated-triton"]["available"]
    assert "selected backend: npu-emulated-triton on cpu" in format_report(data)
    assert data["env"]["LOGITGATE_DEVICE"] == "npu-emulated-triton"


def test_npu_emulated_triton_without_the_interpreter_says_why(monkeypatch):
    from logitgate.backends import DeviceUnavailableError
    from logitgate.cli.doctor import report

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(DeviceUnavailableError, match="npu-emulated-triton.*TRITON_INTERPRET=1"):
        get_backend("npu-emulated-triton")
    assert "TRITON_INTERPRET=1" in report("npu-emulated-triton")["backend"]["error"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_triton_kernel_entries_name_a_tensor_on_another_device():
    """The device backends' Triton entry points check where their tensors are: a tensor on another
    device (CPU tensors given to CUDA on the GPU check) is named, not Triton's "Pointer argument
    cannot be accessed from Triton (cpu tensor?)". Here the backend runs on the CPU, the tensor is
    on meta."""
    from logitgate.backends.base import CandidateRows

    backend = EmulatedNpuBackend(triton_ascend=True, vector_cores=4)
    meta = torch.zeros(2, 64, device="meta")
    index = torch.zeros(2, dtype=torch.int64)
    candidates = CandidateRows(index, index, index, torch.zeros(4, dtype=torch.int32), 1)
    message = "logits is on meta but backend 'npu-emulated-triton' runs on cpu"
    with pytest.raises(ValueError, match=message):
        backend.gather_candidate_logits(meta, candidates)
    with pytest.raises(ValueError, match=message):
        backend.keep_candidate_logits(meta, candidates)
    with pytest.raises(ValueError, match="starts is on meta"):
        backend.gather_candidate_logits(torch.zeros(2, 64), candidates._replace(starts=index.to("meta")))
    with pytest.raises(ValueError, match="bitmask is on meta"):
        backend.fill_tree_bitmask(torch.zeros(2, 2, dtype=torch.int32, device="meta"), index, index, candidates.allow_tok, index, 1, None, None)
    with pytest.raises(ValueError, match="target_logits is on meta"):
        backend.rejection_greedy_accept(torch.tensor([1, 2], dtype=torch.int32), index, meta, None)
    with pytest.raises(ValueError, match="noise is on meta"):
        backend.rejection_recover(torch.tensor([1, 2], dtype=torch.int32), index, torch.zeros(2, 64), None, None,
                                  index.int(), torch.zeros(2), meta, None)
    with pytest.raises(ValueError, match="bitmask is on meta"):
        backend.apply_token_bitmask(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32, device="meta"), None, 64)
    with pytest.raises(ValueError, match="p is on meta"):
        backend.apply_top_k_top_p(torch.zeros(2, 64), None, torch.ones(2, device="meta"), None)
