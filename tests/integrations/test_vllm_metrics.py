"""logitgate's counters for vLLM's /metrics (integrations/vllm/metrics.py) without an engine: the
table, the API's checks, and the transport across processes as vLLM starts them (spawned and
forked children of the server's first process), read both ways vLLM serves /metrics: the default
registry (one API server) and prometheus_client's MultiProcessCollector over
PROMETHEUS_MULTIPROC_DIR (`--api-server-count` > 1). The real servers are tests/vllm_engine's
(test_hostile_server.py, test_served_modes.py, test_metrics_in_process.py, test_engine_kernels.py)."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("prometheus_client")  # a dependency of vLLM's (make test installs it with vLLM's interface)

from logitgate.integrations.vllm import metrics  # noqa: E402


@pytest.fixture()
def fresh(monkeypatch, tmp_path):
    """This process's counts from zero, written under tmp_path, never logged (the test process is
    no vLLM server: nothing of it leaks into the environment other tests start servers with)."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(metrics, "_counts", metrics._Counts())
    monkeypatch.setattr(metrics, "log_interval", lambda: 3600.0)
    return tmp_path


def test_every_counter_is_declared_once_with_a_prometheus_name_and_help():
    for name, counter in metrics.COUNTERS.items():
        assert counter.name == name and re.fullmatch(r"[a-z][a-z0-9_]*[a-z0-9]", name), name
        assert not name.startswith("logitgate") and not name.endswith("_total"), name  # both are added
        assert counter.exposed == f"logitgate_{name}_total" and counter.help.strip(), name
    assert len({c.exposed for c in metrics.COUNTERS.values()}) == len(metrics.COUNTERS)


def test_counts_add_up_in_this_process_and_in_its_file(fresh):
    metrics.add("scheduler_fill_rows", 3)
    metrics.add("scheduler_fill_rows")
    with metrics.timed("scheduler_fill_seconds"):
        time.sleep(0.01)
    counts = metrics.snapshot()
    assert counts["scheduler_fill_rows"] == 4 and counts["scheduler_fill_seconds"] >= 0.01
    assert counts["fill_ahead_batches"] == 0
    from prometheus_client.mmap_dict import MmapedDict

    [path] = fresh.glob("counter_logitgate-*.db")
    written = {json.loads(key)[1]: value for key, value, _, _ in MmapedDict.read_all_values_from_file(str(path))}
    assert written == {c.exposed: counts[name] for name, c in metrics.COUNTERS.items()}  # every counter, zeros too


def test_a_timed_block_that_raises_still_counts_its_time(fresh):
    with pytest.raises(RuntimeError), metrics.timed("scheduler_fill_seconds"):
        time.sleep(0.01)
        raise RuntimeError("fill failed")
    assert metrics.snapshot()["scheduler_fill_seconds"] >= 0.01


def test_misuse_names_the_problem(fresh):
    with pytest.raises(KeyError, match="'rows_deferred' is not a logitgate counter: declare it in COUNTERS"):
        metrics.add("rows_deferred")
    with pytest.raises(ValueError, match="counter 'scheduler_fill_rows' only goes up: got -1"):
        metrics.add("scheduler_fill_rows", -1)
    with pytest.raises(ValueError, match="a time goes to a counter whose name ends in _seconds"):
        with metrics.timed("scheduler_fill_rows"):
            pass
    assert not any(metrics.snapshot().values())


def _logged(level: int = logging.INFO) -> list[str]:
    """Messages of vllm.logitgate.metrics, collected by a handler of its own (vLLM's logger need not
    propagate to pytest's)."""
    lines: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("vllm.logitgate.metrics")
    log.addHandler(handler)
    if log.getEffectiveLevel() > level:
        log.setLevel(level)
    return lines


@pytest.fixture()
def logged():
    log = logging.getLogger("vllm.logitgate.metrics")
    handlers, level = list(log.handlers), log.level
    yield _logged
    log.handlers[:] = handlers
    log.setLevel(level)


def test_a_directory_that_cannot_be_written_keeps_counting_here_and_says_so(monkeypatch, tmp_path, logged):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "missing"))
    monkeypatch.setattr(metrics, "_counts", metrics._Counts())
    monkeypatch.setattr(metrics, "log_interval", lambda: 3600.0)
    lines = logged(logging.WARNING)
    metrics.add("fill_ahead_batches")
    metrics.add("fill_ahead_batches")
    assert metrics.snapshot()["fill_ahead_batches"] == 2
    assert len(lines) == 1 and "cannot write counters" in lines[0] and "missing" in lines[0], lines


def test_the_periodic_line_shows_what_moved_in_the_interval_and_the_totals(fresh, monkeypatch, logged):
    assert metrics.log_line({"fill_ahead_batches": 12.0, "scheduler_fill_seconds": 0.5, "scheduler_fill_rows": 0.0},
                            {"fill_ahead_batches": 9.0, "scheduler_fill_seconds": 0.25}, 10.0) == (
        "logitgate counters, last 10 s (total): fill ahead batches +3 (12), scheduler fill seconds +0.250 (0.500)")
    monkeypatch.setattr(metrics, "log_interval", lambda: 0.05)
    lines = logged()
    metrics.add("scheduler_fill_batches", 2)
    deadline = time.monotonic() + 10
    while not lines and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # nothing moves: no more lines
    assert lines == ["logitgate counters, last 0.05 s (total): scheduler fill batches +2 (2)"]



def test_a_logger_whose_counts_were_replaced_while_it_slept_says_nothing(fresh, monkeypatch, logged):
    # New counts (a test's, a forked child's) must not hear the old ones' line: CI once saw an
    # earlier test's 10 s line land in the test above.
    monkeypatch.setattr(metrics, "log_interval", lambda: 0.2)
    lines = logged()
    before = set(threading.enumerate())
    metrics.add("scheduler_fill_batches", 2)  # starts these counts' logger, which sleeps 0.2 s
    [logger_thread] = [t for t in set(threading.enumerate()) - before if t.name == "logitgate-metrics-log"]
    monkeypatch.setattr(metrics, "_counts", metrics._Counts())
    logger_thread.join(5)
    assert not logger_thread.is_alive() and lines == []

# A vLLM server in miniature: this process registers the plugin's metrics (the API server, or the
# LLM program), then vLLM starts its engine core and worker from it (spawned or forked), which count.
SERVER = """
import json, multiprocessing, os, sys
from functools import partial
from logitgate.integrations.vllm import metrics

if __name__ == "__main__":
    metrics.install()
    metrics.add("scheduler_fill_rows", 1)  # counted before a fork: the parent's, never the child's too
    for method, amount in (("spawn", 10), ("fork", 100)):
        child = multiprocessing.get_context(method).Process(target=partial(metrics.add, "scheduler_fill_rows", amount))
        child.start()
        child.join()
        assert child.exitcode == 0, method
    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    served = {"default": generate_latest(REGISTRY).decode()}
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # how vLLM's API servers serve /metrics then
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        served["multiprocess"] = generate_latest(registry).decode()
    print("RESULT " + json.dumps({**served, "directory": metrics.directory()}))
"""


def _server(tmp_path, **env: str) -> dict:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    base = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", metrics.DIR_ENV)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**base, "PYTHONPATH": os.pathsep.join(sys.path), **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT "):])


def _logitgate_samples(page: str) -> dict[str, float]:
    return {line.split()[0]: float(line.split()[1]) for line in page.splitlines() if line.startswith("logitgate_")}


def test_counts_of_every_process_of_a_server_reach_its_default_registry(tmp_path):
    """One API server (PROMETHEUS_MULTIPROC_DIR unset): vLLM serves prometheus_client's default
    registry. A stale directory inherited from outside the server is not used, and the server's
    own is removed when it exits."""
    stale = tmp_path / "stale"
    stale.mkdir()
    run = _server(tmp_path, **{metrics.DIR_ENV: str(stale)})
    samples = _logitgate_samples(run["default"])
    assert samples == {c.exposed: 111.0 if name == "scheduler_fill_rows" else 0.0 for name, c in metrics.COUNTERS.items()}
    for counter in metrics.COUNTERS.values():  # Prometheus conventions: a counter, with its help
        name = counter.exposed  # prometheus_client's text format names a counter's family with `_total`
        assert f"# TYPE {name} counter" in run["default"] and f"# HELP {name} {counter.help}" in run["default"]
    assert run["directory"] != str(stale) and list(stale.iterdir()) == []
    assert not os.path.exists(run["directory"])


def test_counts_of_every_process_reach_vllms_multiprocess_registry(tmp_path):
    """`--api-server-count` > 1: vLLM sets PROMETHEUS_MULTIPROC_DIR and each API server serves every
    file there through MultiProcessCollector; the default registry then adds nothing (no duplicates)."""
    shared = tmp_path / "prometheus"
    shared.mkdir()
    run = _server(tmp_path, PROMETHEUS_MULTIPROC_DIR=str(shared))
    assert _logitgate_samples(run["multiprocess"])["logitgate_scheduler_fill_rows_total"] == 111.0
    assert set(_logitgate_samples(run["multiprocess"])) == {c.exposed for c in metrics.COUNTERS.values()}
    assert _logitgate_samples(run["default"]) == {}
    assert run["directory"] == str(shared)
