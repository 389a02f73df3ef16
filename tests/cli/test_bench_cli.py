import io
import json

import pytest

from logitgate.bench import harness as bench_harness
from logitgate.cli import bench as bench_cli
from logitgate.cli.main import main


def test_cases_split_times_speedups_and_time_ratios():
    row = {"shape": "64x128256", "dtype": "float32", "allowed": 0.5, "logitgate_ms": 1.0, "logitgate_ms_min": 0.9,
           "logitgate_spread": 0.05, "memcpy_ms": 1.2, "vs_memcpy": 0.83, "speedup_vs_xgrammar_cpu": 6.0}
    [case] = bench_cli.cases({"rows": [row]})
    assert case.name == "64x128256 float32 allowed=50%"
    assert case.times_ms == {"logitgate": 1.0, "memcpy": 1.2}  # min/max are not times of their own
    assert case.speedups == {"vs xgrammar cpu": 6.0}
    assert case.time_ratios == {"vs memcpy": 0.83}
    assert case.noisy == {}


def test_ratio_keys_and_row_lists():
    result = {"results": [{"op": "top_k", "vocab": 32000, "dense_speedup_vs_rtp": 3.0, "time_ms": 1.0, "x_ratio": 0.5}]}
    [case] = bench_cli.cases(result)
    assert case.name == "top_k vocab=32000"
    assert case.speedups == {"dense vs rtp": 3.0} and case.time_ratios == {"x": 0.5}


def test_noisy_runs_are_flagged_in_their_own_column():
    row = {"case": "a long case name that must not be cut off anywhere in the table", "logitgate_ms": 2.0,
           "logitgate_spread": 0.6, "memcpy_ms": 1.0, "memcpy_spread": 0.1, "vs_memcpy": 2.0, "speedup_vs_x": 3.0}
    summary = {"fake": {"seconds": 1.0, "cases": [vars(c) for c in bench_cli.cases({"rows": [row]})]}}
    text = bench_cli.format_table(summary)
    header, _, line = text.splitlines()[1:4]
    assert row["case"] in line
    assert "NOISY logitgate 60%" in line and "memcpy (floor) 1" in line
    # Each direction has its own column: the speedup sits under the speedup header, the time ratio
    # under the time-ratio header.
    assert line.index("vs x 3.00") == header.index("logitgate speedup")
    assert line.index("vs memcpy 2.00") == header.index("logitgate time / other")
    md = bench_cli.format_table(summary, markdown=True)
    assert "| a long case name that must not be cut off anywhere in the table |" in md


def test_unknown_benchmark_is_named():
    with pytest.raises(ValueError, match="unknown benchmark.*nope"):
        bench_cli.discover(["nope"])


def test_only_without_names_lists_the_names(capsys):
    with pytest.raises(ValueError, match="--only needs one or more benchmark names: bitmask, .*rejection, sampling"):
        bench_cli.discover([])
    assert main(["bench", "--only"]) == 2
    assert "bitmask" in capsys.readouterr().err


def test_progress_lines_have_step_and_eta():
    stream = io.StringIO()
    progress = bench_harness.Progress(3, "demo", stream=stream)
    for label in ("a", "b", "c"):
        progress.step(label)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[demo] step 1/3: a (") and "ETA ?" in lines[0]
    assert lines[2].startswith("[demo] step 3/3: c (") and "ETA " in lines[2] and "ETA ?" not in lines[2]


def test_timing_fields_and_round_robin():
    timing = bench_harness.Timing((0.001, 0.002, 0.003, 0.010))
    fields = timing.fields("x")
    assert fields["x_ms"] == pytest.approx(2.5) and fields["x_ms_min"] == pytest.approx(1.0)
    assert fields["x_ms_max"] == pytest.approx(10.0) and fields["x_spread"] > bench_harness.NOISY_SPREAD
    order = []
    runs = bench_harness.round_robin({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, {"a": 2, "b": 1})
    assert len(runs["a"].runs) == 2 and len(runs["b"].runs) == 1
    assert order == ["a", "a", "b", "b", "a", "a"]  # interleaved, each timed run after a warm-up run


def test_colours_are_fixed_per_implementation_and_labels_readable():
    assert bench_harness.impl_colour("logitgate") == bench_harness.impl_colour("logitgate")
    assert bench_harness.impl_colour("some_new_baseline") == bench_harness.impl_colour("some_new_baseline")
    assert bench_harness.impl_label("xgrammar_cpu") == "xgrammar CPU kernel"
    assert bench_harness.impl_label("some_new_baseline") == "some new baseline"


def test_plot_is_log_scale_with_machine_and_threads_in_title(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen = {}
    real_savefig = plt.Figure.savefig

    def capture(fig, path, **kw):
        ax = fig.axes[0]
        seen.update(scale=ax.get_yscale(), title=ax.get_title(), legend=[t.get_text() for t in ax.get_legend().get_texts()],
                    colours=[p.get_facecolor() for p in ax.patches])
        return real_savefig(fig, path, **kw)

    monkeypatch.setattr(plt.Figure, "savefig", capture)
    rows = [{"case": "c1", "logitgate_ms": 0.1, "logitgate_ms_min": 0.09, "logitgate_ms_max": 0.2, "logitgate_spread": 0.5,
             "xgrammar_cpu_ms": 20.0}]
    bench_harness.plot_bars(rows, "case", ["logitgate", "xgrammar_cpu_ms"], "t", str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert seen["scale"] == "log"
    assert bench_harness.machine_label() in seen["title"] and "threads" in seen["title"]
    assert seen["legend"][:2] == ["logitgate", "xgrammar CPU kernel"] and "noisy" in seen["legend"][2]
    assert seen["colours"][:2] == [matplotlib.colors.to_rgba(bench_harness.impl_colour(n)) for n in ("logitgate", "xgrammar_cpu")]


def test_bench_runs_a_module_forwards_progress_and_writes_tables(tmp_path, monkeypatch, capsys):
    """Each benchmark runs as `python -m <package>.<name>` in a fresh process (no path to a checkout's
    scripts: an installed package runs its own)."""
    module = tmp_path / "fakebench" / "fake.py"
    module.parent.mkdir()
    (module.parent / "__init__.py").write_text("")
    module.write_text(
        "import argparse, json, sys\n"
        "p = argparse.ArgumentParser(); p.add_argument('--out'); p.add_argument('--plot'); p.add_argument('--quick', action='store_true')\n"
        "a = p.parse_args()\n"
        "sys.stderr.write('[fake] step 1/1: the case (0s elapsed, ETA ?)\\n')\n"
        "open(a.out, 'w').write(json.dumps({'rows': [{'case': 'c', 'logitgate_ms': 1.0, 'speedup_vs_base': 2.0}]}))\n"
        "open(a.plot, 'wb').write(b'png')\n"
    )
    monkeypatch.setattr(bench_cli, "BENCH_PACKAGE", "fakebench")
    monkeypatch.setattr(bench_cli, "BENCHMARKS", ("fake",))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    summary = bench_cli.run(str(tmp_path / "out"), quick=True)
    assert summary["fake"]["cases"][0]["speedups"] == {"vs base": 2.0}
    assert "[fake] step 1/1: the case" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["fake"]["cases"]
    assert "| c | logitgate 1 | vs base 2.00 |" in (tmp_path / "out" / "summary.md").read_text()


def test_every_benchmark_is_a_module_of_the_package():
    import importlib.util

    for name in bench_cli.available():
        assert importlib.util.find_spec(f"logitgate.bench.{name}") is not None, name


def test_out_that_cannot_be_a_folder_is_exit_status_2(tmp_path, capsys):
    """`bench --out` under a file (or on one): exit status 2 naming the path, before any benchmark
    runs; the same for `bench --gpu --out`, before the GPU check starts."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for argv in (["bench", "--only", "tree"], ["bench", "--gpu"]):
        for out in (blocker, blocker / "results"):
            assert main([*argv, "--out", str(out)]) == 2
            err = capsys.readouterr().err
            assert f"--out {str(out)!r} cannot be written: a file is in the way" in err, err
    assert blocker.read_text() == "x"
