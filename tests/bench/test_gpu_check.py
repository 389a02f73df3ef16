"""The GPU check's logic on the CPU: argument handling, package installation from the wheel folder,
the dry run end to end (same benchmark code on CPU tensors) and its JSON / markdown, junit parsing,
and `logitgate bench --gpu`. The hardware run itself needs a GPU (see docs/gpu-check.md)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from logitgate.bench.gpu_check import config, suite, wheels
from logitgate.bench.gpu_check import main as gpu_check

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the checkout whose logitgate the tests import


def test_arguments_defaults_and_errors(capsys):
    args = gpu_check.parse_args([])
    assert args.device == "cuda" and args.budget_s == 600 and not args.quick
    assert Path(args.out).parent.name == "gpu-check-out" and args.out.endswith("-cuda")
    assert gpu_check.parse_args(["--device", "cpu", "--out", "x"]).out == "x"
    for bad in (["--device", "tpu"], ["--repeats", "1"], ["--budget-s", "0"]):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(bad)
    err = capsys.readouterr().err
    assert "invalid choice: 'tpu'" in err and "--repeats must be at least 3" in err and "--budget-s must be positive" in err


def test_cuda_requested_without_cuda_is_a_clear_error(tmp_path, capsys):
    from logitgate.backends import probe_cuda

    if probe_cuda().available:
        pytest.skip("this host has CUDA")
    assert gpu_check.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "CUDA is unusable here" in capsys.readouterr().err


def test_missing_packages_install_from_the_wheel_folder_only(tmp_path, monkeypatch):
    needed = {"json": "json", "surely_not_a_module_xyz": "surely-not-a-package"}
    # No wheels: said plainly, nothing attempted.
    status = wheels.ensure_packages(tmp_path / "none", needed)
    assert status["json"] == "present"
    assert status["surely_not_a_module_xyz"].startswith("missing: no wheels in") and "make gpu-wheels" in status["surely_not_a_module_xyz"]
    # With wheels: pip install --no-index --find-links <folder> <the missing ones only>.
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"")
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for surely-not-a-package")

    monkeypatch.setattr(wheels.subprocess, "run", fake_run)
    monkeypatch.setenv("LOGITGATE_GPU_SITE", "")  # restored (removed) after the test
    status = wheels.ensure_packages(tmp_path, needed, site=tmp_path / "site")
    [cmd, fallback] = calls
    assert cmd[1:4] == ["-m", "pip", "install"] and "--no-index" in cmd
    assert cmd[cmd.index("--find-links") + 1] == str(tmp_path) and cmd[-1] == "surely-not-a-package" and "json" not in cmd
    # Refused (e.g. an externally managed Python): every wheel, no deps, into a folder of its own.
    assert "--no-index" in fallback and "--no-deps" in fallback
    assert fallback[fallback.index("--target") + 1] == str(tmp_path / "site") and fallback[-1] == str(tmp_path / "a-1.0-py3-none-any.whl")
    assert status["surely_not_a_module_xyz"] == "missing: pip install failed: ERROR: No matching distribution found for surely-not-a-package"


def test_wheels_installed_into_a_site_folder_come_after_the_machines_packages(tmp_path, monkeypatch):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "fakepkg_gpu_check-1.0-py3-none-any.whl").write_bytes(b"")
    site = tmp_path / "site"

    def fake_run(cmd, **kwargs):
        if "--target" not in cmd:
            return subprocess.CompletedProcess(cmd, 1, "", "error: externally-managed-environment")
        site.mkdir()
        (site / "fakepkg_gpu_check.py").write_text("")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(wheels.subprocess, "run", fake_run)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("LOGITGATE_GPU_SITE", "")  # restored (removed) after the test
    status = wheels.ensure_packages(tmp_path / "w", {"fakepkg_gpu_check": "fakepkg-gpu-check"}, site=site)
    assert status == {"fakepkg_gpu_check": f"installed from {tmp_path / 'w'} into {site}"}
    assert sys.path[-1] == str(site) and __import__("os").environ["LOGITGATE_GPU_SITE"] == str(site)


def test_junit_counts_and_failures(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="1" skipped="1">'
        '<testcase classname="tests.a" name="test_ok"/>'
        '<testcase classname="tests.a" name="test_bad"><failure message="assert 1 == 2&#10;more">tb</failure></testcase>'
        '<testcase classname="tests.b" name="test_err"><error message="RuntimeError: sync">tb</error></testcase>'
        '<testcase classname="tests.b" name="test_skip"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    result = suite.parse_junit(xml)
    assert (result["tests"], result["passed"], result["failures"], result["errors"], result["skipped"]) == (4, 1, 1, 1, 1)
    assert result["failed"] == ["tests.a::test_bad (failure): assert 1 == 2", "tests.b::test_err (error): RuntimeError: sync"]


def test_dry_run_end_to_end_writes_json_and_markdown(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(config.SHAPES, "cpu", {
        "bitmask": [(2, 1000)], "bitmask_grammar": (2, 1000), "sampling": (2, 1000), "rejection": (2, 2, 1000),
        "tree": (4, 4096, 50), "noise": (2, 1000)})
    test_file = tmp_path / "test_tiny.py"
    test_file.write_text("def test_one():\n    assert 1 + 1 == 2\n")
    out = tmp_path / "out"
    rc = gpu_check.main(["--device", "cpu", "--out", str(out), "--repeats", "3", "--pytest-args", f"-q {test_file}"])
    assert rc == 0
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["environment"]["device"] == "cpu" and report["passed"] is True
    assert report["sync_check"]["checked"] is False and set(report["sync_check"]["parts"].values()) == {"ok"}
    assert report["overlap_check"]["checked"] is False
    [bitmask_f32, bitmask_bf16, bitmask_grammar] = report["benchmarks"]["bitmask"]
    assert (bitmask_f32["dtype"], bitmask_bf16["dtype"]) == ("float32", "bfloat16")
    assert bitmask_grammar["mask"].startswith("grammar-like")
    assert set(bitmask_f32["impl"]) >= {"copy", "logitgate", "logitgate_v2", "torch_masked_fill", "xgrammar"}
    assert all(bitmask_f32["correct"].values()) and all(bitmask_grammar["correct"].values())
    assert bitmask_f32["impl"]["copy"]["fraction_of_copy"] == pytest.approx(1.0)
    for m in bitmask_f32["impl"].values():
        assert m["us_min"] <= m["us"] <= m["us_max"] and m["gbps"] > 0
    [sampling, sampling_top_p] = report["benchmarks"]["sampling"]
    assert "top_k 50" in sampling["case"] and "top_k" not in sampling_top_p["case"]
    assert set(sampling["impl"]) == {"one_read_floor", "logitgate", "logitgate_v2", "vllm_torch", "sort_reference"}
    assert sampling["vs_one_read_floor"] == pytest.approx(sampling["impl"]["logitgate"]["us"] / sampling["impl"]["one_read_floor"]["us"])
    assert sampling["correct"] == {"logitgate": True, "logitgate_v2": True}  # the reference's draw with the same noise
    [rejection] = report["benchmarks"]["rejection"]
    assert set(rejection["impl"]) == {"one_read_floor", "logitgate", "logitgate_v2", "vllm_torch"} and rejection["shape"] == "B=2 k=2 V=1000"
    assert rejection["correct"] == {"logitgate": True, "logitgate_v2": True}
    # current vs v2 of each op, timed interleaved: the ratio and the faster one, in the JSON and the markdown.
    assert set(report["variants"]) == {"bitmask", "sampling", "rejection"} and len(report["variants"]["bitmask"]) == 3
    for op_rows in report["variants"].values():
        for v in op_rows:
            assert v["speedup_v2"] == pytest.approx(v["current_us"] / v["v2_us"]) and v["faster"] in ("current", "v2")
    assert rejection["variants"]["correct"] == {"current": True, "v2": True}
    assert {"apply_token_bitmask, v2", "rejection_sample, v2"} <= set(report["sync_check"]["parts"])
    [tree] = report["benchmarks"]["tree"]
    assert {"fill_bitmask", "fill_and_apply", "candidates", "advance"} <= set(tree["impl"])
    # The sparse path's kernels against their torch reference, timed and checked equal.
    assert {"gather_candidates", "gather_candidates_torch", "keep_only_allowed", "keep_only_allowed_torch",
            "fill_bitmask_torch"} <= set(tree["impl"])
    assert tree["correct"] == {"fill_bitmask": True, "gather_candidates": True, "keep_only_allowed": True}
    assert tree["speedup_gather_vs_torch"] == pytest.approx(
        tree["impl"]["gather_candidates_torch"]["us"] / tree["impl"]["gather_candidates"]["us"])
    assert 1 <= tree["layout_width"] <= tree["max_width"]
    assert {"tree gather candidates (sparse layout)", "tree keep only allowed"} <= set(report["sync_check"]["parts"])
    assert report["benchmarks"]["errors"] == {}
    assert report["tests"]["passed"] == 1 and report["tests"]["passed_all"] is True
    md = (out / "gpu_check.md").read_text()
    assert "| 2x1000 | float32 | 50% allowed, random | logitgate |" in md and "## Rejection sampling" in md and "1 passed, 0 failed" in md
    assert "## CUDA kernel variants: current vs v2" in md and "| rejection | B=2 k=2 V=1000, random" in md
    assert "| gather_candidates_torch |" in md and "equal to the torch reference: fill_bitmask True" in md
    assert md.rstrip().endswith("s).") and "Overall: PASS" in md
    assert "[gpu-check] step 1/" in capsys.readouterr().err


def test_a_failing_test_fails_the_check(tmp_path):
    test_file = tmp_path / "test_red.py"
    test_file.write_text("def test_red():\n    assert False, 'red'\n")
    out = tmp_path / "out"
    assert gpu_check.main(["--device", "cpu", "--out", str(out), "--skip-bench", "--pytest-args", f"-q {test_file}"]) == 1
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["passed"] is False and report["tests"]["failures"] == 1
    assert "test_red" in report["tests"]["failed"][0]


def test_logitgate_bench_gpu_runs_the_check(monkeypatch, capsys):
    from logitgate.cli import bench as bench_cli
    from logitgate.cli.main import main

    calls = []
    monkeypatch.setattr(bench_cli.subprocess, "run", lambda cmd, **kw: calls.append((cmd, kw)) or subprocess.CompletedProcess(cmd, 0))
    assert main(["bench", "--gpu", "--device", "cpu", "--quick", "--out", "o"]) == 0
    [(cmd, kw)] = calls
    assert cmd[1:3] == ["-m", "logitgate.bench.gpu_check"] and cmd[3:] == ["--out", "o", "--quick", "--device", "cpu"]
    assert kw["env"]["PYTHONPATH"].split(":")[0] == str(PACKAGE_ROOT)  # this checkout's logitgate
    assert main(["bench", "--gpu", "--only", "bitmask"]) == 2
    assert "--only does not apply to --gpu" in capsys.readouterr().err


def test_vllm_sampling_baseline_draws_only_what_the_reference_keeps():
    import torch

    from logitgate.backends.reference import apply_top_k_top_p_reference
    from logitgate.bench.sampling import vllm_top_k_top_p_sample

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 200, generator=g) * 3
    for k, p in ((torch.full((6,), 5), None), (None, torch.full((6,), 0.6)), (torch.full((6,), 20), torch.full((6,), 0.8))):
        kept = torch.isfinite(apply_top_k_top_p_reference(logits.clone(), k, p))
        for _ in range(20):
            tokens = vllm_top_k_top_p_sample(logits.clone(), k, p)
            assert kept.gather(1, tokens.unsqueeze(1)).all()
