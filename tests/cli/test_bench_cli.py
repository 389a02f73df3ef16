import json

import pytest

from logitgate.cli import bench as bench_cli


def test_ratios_are_extracted_with_their_case():
    result = {"rows": [{"shape": "64x128256", "allowed": 0.5, "logitgate_ms": 1.0, "vs_memcpy": 1.2, "speedup_vs_x": 6.0}]}
    assert bench_cli.ratios(result) == [
        ("shape=64x128256 allowed=0.5", "vs_memcpy", 1.2),
        ("shape=64x128256 allowed=0.5", "speedup_vs_x", 6.0),
    ]


def test_ratio_keys_and_row_lists():
    result = {"results": [{"op": "top_k", "vocab": 32000, "dense_speedup_vs_rtp": 3.0, "time_ms": 1.0, "x_ratio": 0.5}]}
    assert bench_cli.ratios(result) == [
        ("op=top_k vocab=32000", "dense_speedup_vs_rtp", 3.0),
        ("op=top_k vocab=32000", "x_ratio", 0.5),
    ]


def test_unknown_benchmark_is_named():
    with pytest.raises(ValueError, match="unknown benchmark.*nope"):
        bench_cli.discover(["nope"])


def test_bench_runs_a_script_and_writes_json_and_png(tmp_path, monkeypatch):
    script = tmp_path / "scripts" / "bench_fake.py"
    script.parent.mkdir()
    script.write_text(
        "import argparse, json\n"
        "p = argparse.ArgumentParser(); p.add_argument('--out'); p.add_argument('--plot'); p.add_argument('--quick', action='store_true')\n"
        "a = p.parse_args()\n"
        "open(a.out, 'w').write(json.dumps({'rows': [{'case': 'c', 'speedup_vs_base': 2.0}]}))\n"
        "open(a.plot, 'wb').write(b'png')\n"
    )
    monkeypatch.setattr(bench_cli, "SCRIPTS_DIR", script.parent)
    summary = bench_cli.run(str(tmp_path / "out"), quick=True)
    assert summary["fake"]["ratios"] == [("case=c", "speedup_vs_base", 2.0)]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["fake"]["ratios"]
    assert "speedup_vs_base" in bench_cli.format_table(summary)
