"""Where the plugin's time goes: logitgate's counters in vLLM's Prometheus `/metrics`, in every
process layout, and one periodic INFO line per counting process.

The API, for the plugin's code in whichever vLLM process it runs (engine core, worker, both):

    from . import metrics

    metrics.add("scheduler_fill_rows", rows)        # add(name: str, amount: float = 1) -> None
    metrics.add("scheduler_fill_seconds", seconds)  # a `_seconds` counter takes seconds (perf_counter differences)
    with metrics.timed("scheduler_fill_seconds"):   # timed(name: str): the block's wall time, added when it
        ...                                         # ends, an exception included
    metrics.snapshot()                              # this process's counts: {name: value}

`name` is a row of COUNTERS below: adding a counter is one `Counter(name, help)` line there (the
tests check that every row reaches /metrics). A name that is not declared raises KeyError, a
negative amount ValueError (counters only go up), `timed` of a name not ending in `_seconds`
ValueError. Each is exposed as the Prometheus counter `logitgate_<name>_total`; time is in
seconds, named `..._seconds` (Prometheus conventions). `add` costs a dict look-up, a lock and a
16-byte write into a memory-mapped file (about a microsecond): cheap per step, safe from any thread.

The `sample_first` counters are counted where their facts are known: the scheduler (engine core)
counts the rows it defers and, from the worker's report, each deferred row's outcome and the
worker's time on it; the worker counts the mirrors it starts and drops (their difference is the
mirrors it holds).

How the counts reach /metrics (vLLM's API server serves it, while the counts happen in the engine
core and the worker, each a process of its own with vLLM's defaults): every process writes its
totals into a file of its own, `counter_logitgate-<pid>.db`, in prometheus_client's multiprocess
format (prometheus_client.mmap_dict), in one directory per server:
- PROMETHEUS_MULTIPROC_DIR where it is set: vLLM sets it for `--api-server-count` > 1 (and so for
  data parallelism, one API server per engine) before it starts any other process, and each API
  server then serves every file there through prometheus_client's MultiProcessCollector;
- otherwise a temporary directory that the server's first process (the API server, the `LLM`
  program, or `vllm serve`'s launcher: a process with no multiprocessing parent) creates when the
  plugin registers, before vLLM starts any other process, and names in LOGITGATE_VLLM_METRICS_DIR
  for the processes vLLM starts from it (removed when that process exits). A collector in
  prometheus_client's default registry, the one vLLM's /metrics serves in this case, sums it.
Counts of processes that have ended stay counted. Nothing is written on vLLM's objects (no patch
table row). Imports: the standard library and prometheus_client (a small pure-Python dependency of
vLLM's) when the plugin registers, vllm.envs in the logging thread; never numba or torch.

The periodic line: each process that counts logs, every VLLM_LOG_STATS_INTERVAL seconds (vLLM's
own stats interval, 10 s by default) while its counters move, what it counted in the interval and
in total, through vLLM's handler ("logitgate counters, last 10 s (total): ...").
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ... import envs

__all__ = ["COUNTERS", "Counter", "add", "install", "snapshot", "timed"]

logger = logging.getLogger("vllm.logitgate.metrics")

PREFIX = "logitgate_"
DIR_ENV = "LOGITGATE_VLLM_METRICS_DIR"
# prometheus_client's MultiProcessCollector reads a file's metric type from its name, up to the first "_".
FILE_PREFIX = "counter_logitgate-"


@dataclass(frozen=True)
class Counter:
    name: str  # exposed as logitgate_<name>_total; `_seconds` at the end: seconds
    help: str

    @property
    def exposed(self) -> str:
        return f"{PREFIX}{self.name}_total"


def _declare(*counters: Counter) -> dict[str, Counter]:
    return {c.name: c for c in counters}


COUNTERS: dict[str, Counter] = _declare(
    Counter("fill_ahead_batches", "batches whose grammar bitmask the scheduler started filling while the model ran"),
    Counter("scheduler_fill_batches", "batches whose grammar bitmask the scheduler computed, ahead or in the engine step"),
    Counter("scheduler_fill_rows", "grammar-bitmask rows the scheduler filled in those batches (rows sample_first "
                                   "deferred are not filled: see sample_first_rows_deferred)"),
    Counter("scheduler_fill_seconds", "seconds the scheduler spent computing those bitmasks"),
    Counter("scheduler_fill_wait_seconds", "seconds engine steps waited for their bitmask (the fill not hidden behind "
                                           "the forward pass)"),
    Counter("sample_first_rows_deferred", "rows the scheduler left unfilled to sample first (sample_first)"),
    Counter("sample_first_bonus_rows_deferred", "of those, bonus rows after forced drafts (checked past the drafts)"),
    Counter("sample_first_rows_accepted", "deferred rows whose first draw their grammar accepted"),
    Counter("sample_first_rows_redrawn", "deferred rows whose draw was rejected, settled among their best keys"),
    Counter("sample_first_rows_filled", "deferred rows whose draw was rejected, settled through a mask the worker filled"),
    Counter("sample_first_rows_unchecked", "deferred rows no grammar could check in the worker (a mirror out of step; "
                                           "the scheduler's grammar checked the token)"),
    Counter("sample_first_check_seconds", "worker seconds checking accepted rows (mirror advance included)"),
    Counter("sample_first_settle_seconds", "worker seconds on rejected rows (check, race, candidates, fills)"),
    Counter("sample_first_mirrors_asked", "requests the scheduler asked the worker to mirror"),
    Counter("sample_first_mirrors_failed", "mirrors the worker could not build (their requests are filled by the scheduler)"),
    Counter("sample_first_mirrors_started", "grammar mirrors the worker started compiling"),
    Counter("sample_first_mirrors_dropped", "grammar mirrors the worker dropped (request finished, failed, out of step)"),
    *(counter for backend in ("xgrammar", "guidance", "tree") for counter in (
        Counter(f"forced_proposed_{backend}", f"forced tokens of {backend} requests proposed as drafts (forced)"),
        Counter(f"forced_accepted_{backend}", f"forced drafts of {backend} requests the verification accepted"),
        Counter(f"forced_passes_saved_{backend}", f"decode passes {backend} requests did not take: one per accepted "
                                                  "forced draft"),
    )),
    Counter("forced_drafter_preferred", "steps in which a request's forced tokens gave way to a user's drafter's as many or "
                                        "more drafts (checked against its grammar)"),
    Counter("forced_requests_stopped", "requests that stopped proposing forced drafts: the model accepted fewer "
                                       "than half of theirs, or of their schema's requests' (forced.proposals."
                                       "MIN_ACCEPTANCE, SchemaTallies)"),
    Counter("forced_rows_sparse", "draft rows of batches with forced drafts whose logits were computed over the "
                                  "tokens their masks allow"),
    Counter("forced_rows_whole", "draft rows of such batches computed over the whole vocabulary (a user's drafter's "
                                 "rows, a request with a wide or missing mask row or with parameters vLLM's "
                                 "processors apply, a head that is not a plain matrix)"),
    Counter("forced_logits_computed", "logits the LM head computed for the draft rows of such batches (their "
                                      "allowed tokens, or the vocabulary for whole rows)"),
)


class _Counts:
    """This process's counts and the file that shows them to /metrics (opened on first use)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values = dict.fromkeys(COUNTERS, 0.0)
        self.file: Any = None  # prometheus_client's MmapedDict
        self.keys: dict[str, str] = {}
        self.broken = False  # the file could not be opened: counted here and logged only
        self.logging = False

    def open(self) -> None:
        """Open this process's file and write every declared counter (zeros included, so each is
        listed from the start). Lock held by the caller."""
        from prometheus_client.mmap_dict import MmapedDict, mmap_key

        try:
            self.file = MmapedDict(os.path.join(directory(), f"{FILE_PREFIX}{os.getpid()}.db"))
        except OSError as err:  # the error names the path
            self.broken = True
            logger.warning("logitgate: cannot write counters (%s): they stay out of /metrics", err)
            return
        self.keys = {name: mmap_key(PREFIX + name, c.exposed, [], [], c.help) for name, c in COUNTERS.items()}
        for name, value in self.values.items():
            self.file.write_value(self.keys[name], value, 0.0)


_counts = _Counts()
_installed = False
_own_directory: tuple[int, str] | None = None  # (pid of the creator, path) of the directory this process created
_directory_lock = threading.Lock()  # one directory per process, whichever thread asks first


def _after_fork_in_child() -> None:
    # A forked child counts in a file of its own; the parent's counts stay the parent's. Its locks
    # are new: another thread of the parent may have held them at the fork.
    global _counts, _directory_lock
    _counts = _Counts()
    _directory_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def add(name: str, amount: float = 1) -> None:
    """Add `amount` to counter `name` (a row of COUNTERS) in this process."""
    counts = _counts
    if name not in counts.values:
        raise KeyError(f"{name!r} is not a logitgate counter: declare it in COUNTERS ({__name__})")
    if amount < 0:
        raise ValueError(f"counter {name!r} only goes up: got {amount!r}")
    with counts.lock:
        if counts.file is None and not counts.broken:
            counts.open()
        value = counts.values[name] = counts.values[name] + amount
        if counts.file is not None:
            counts.file.write_value(counts.keys[name], value, 0.0)
        if not counts.logging:
            counts.logging = True
            threading.Thread(target=_log_periodically, args=(counts,), name="logitgate-metrics-log", daemon=True).start()


@contextlib.contextmanager
def timed(name: str) -> Iterator[None]:
    """Add the wall time of the block to the `_seconds` counter `name`, also when it raises."""
    if not name.endswith("_seconds"):
        raise ValueError(f"timed({name!r}): a time goes to a counter whose name ends in _seconds")
    start = time.perf_counter()
    try:
        yield
    finally:
        add(name, time.perf_counter() - start)


def snapshot() -> dict[str, float]:
    """This process's counts, by name."""
    with _counts.lock:
        return dict(_counts.values)


def directory() -> str:
    """The directory this server's processes write their counters to (see the module docstring)."""
    prometheus = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if prometheus:
        return prometheus
    inherited = envs.read(DIR_ENV)
    if multiprocessing.parent_process() is not None and inherited and os.path.isdir(inherited):
        return inherited  # started by vLLM from a process of this server
    global _own_directory
    with _directory_lock:
        if _own_directory is None or _own_directory[0] != os.getpid():
            # The first process of a server: a directory for it and the processes vLLM starts from
            # it. A value inherited from elsewhere (a test runner that ran an engine) is replaced.
            path = tempfile.mkdtemp(prefix="logitgate-metrics-")
            _own_directory = (os.getpid(), path)
            os.environ[DIR_ENV] = path
            atexit.register(_remove_own_directory, os.getpid(), path)
        return _own_directory[1]


def _remove_own_directory(creator: int, path: str) -> None:
    if os.getpid() == creator:  # not in a forked child that exits through the interpreter
        shutil.rmtree(path, ignore_errors=True)


class _Collector:
    """Sums the server's counter files for prometheus_client's default registry, which vLLM's
    /metrics serves unless PROMETHEUS_MULTIPROC_DIR is set (then vLLM's own collector reads them)."""

    def describe(self) -> list:
        return []  # nothing to check for duplicates at registration (names come from the files)

    def collect(self) -> Any:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return []
        from prometheus_client.multiprocess import MultiProcessCollector

        return MultiProcessCollector(None, path=directory()).collect()


def install() -> None:
    """At plugin registration, in every vLLM process (idempotent): the server's directory (the
    first process creates it before vLLM starts the others), this process's file with every
    counter at zero, and the collector in prometheus_client's default registry."""
    global _installed
    if _installed:
        return
    from prometheus_client import REGISTRY

    with _counts.lock:
        if _counts.file is None and not _counts.broken:
            _counts.open()
    REGISTRY.register(_Collector())
    _installed = True


def log_interval() -> float:
    """vLLM's stats-logging interval (VLLM_LOG_STATS_INTERVAL, 10 s by default)."""
    from vllm import envs as vllm_envs

    return float(vllm_envs.VLLM_LOG_STATS_INTERVAL)


def log_line(now: dict[str, float], before: dict[str, float], seconds: float) -> str:
    """The periodic line: each counter that is not zero, what it gained in the interval and its total."""
    def number(name: str, value: float) -> str:
        return f"{value:.3f}" if name.endswith("_seconds") else f"{value:.0f}"

    parts = [f"{name.replace('_', ' ')} +{number(name, value - before.get(name, 0.0))} ({number(name, value)})"
             for name, value in now.items() if value]
    return f"logitgate counters, last {seconds:g} s (total): " + ", ".join(parts)


def _log_periodically(counts: _Counts) -> None:
    interval = log_interval()
    before = dict.fromkeys(COUNTERS, 0.0)
    while True:
        time.sleep(interval)
        if counts is not _counts:  # replaced (a forked child, where this thread does not run; tests) while it slept
            return
        with counts.lock:
            now = dict(counts.values)
        if now != before:
            logger.info("%s", log_line(now, before, interval))
            before = now
