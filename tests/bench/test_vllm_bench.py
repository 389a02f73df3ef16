"""logitgate.bench.vllm's command line: `--layouts` picks the offline layouts the json benchmark
runs, and a layout it does not know is refused by name (no engine: the benchmark is replaced)."""
import pytest

import logitgate.bench.vllm as bench_vllm


def test_json_runs_the_layouts_asked_for(monkeypatch, tmp_path):
    asked = []
    monkeypatch.setattr(bench_vllm, "engine_available", lambda python: (True, ""))
    monkeypatch.setattr(bench_vllm, "json_benchmark",
                        lambda python, rounds, repeats, models, layouts: asked.append(layouts) or {"rows": [], "checks": {}})
    bench_vllm.main(["--only", "json", "--models", "random", "--layouts", "in-process", "--out", str(tmp_path / "a.json")])
    bench_vllm.main(["--only", "json", "--models", "random", "--out", str(tmp_path / "b.json")])
    assert asked == [("in-process",), bench_vllm.OFFLINE_LAYOUTS]


def test_an_unknown_layout_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        bench_vllm.main(["--only", "json", "--layouts", "in-process,served"])
    assert "--layouts 'in-process,served'" in capsys.readouterr().err
