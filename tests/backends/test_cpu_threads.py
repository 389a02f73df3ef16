"""Thread defaults of the CPU kernels: the idle cores (cores minus the load average), never all cores
on a loaded host; LOGITGATE_THREADS and an explicit --threads win; numba's setting is restored."""
import numba
import pytest
import torch

import logitgate
from logitgate.backends.cpu import backend as cpu_backend
from logitgate.backends.cpu import threads


@pytest.fixture(autouse=True)
def _fresh_cap(monkeypatch):
    monkeypatch.delenv(threads.ENV_THREADS, raising=False)
    saved = threads._cap
    yield
    threads.set_thread_cap(saved)


@pytest.mark.parametrize(
    "cores, load, expected",
    [(2, 4.7, 1), (2, 1.2, 1), (2, 0.3, 2), (16, 3.4, 13), (16, 0.0, 16), (8, 100.0, 1)],
)
def test_default_is_the_idle_cores(cores, load, expected):
    assert threads.safe_thread_count(cores, load) == expected


def test_environment_override_and_its_errors(monkeypatch):
    monkeypatch.setenv(threads.ENV_THREADS, "3")
    assert threads.safe_thread_count(2, 5.0) == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(threads.ENV_THREADS, bad)
        with pytest.raises(ValueError, match=f"LOGITGATE_THREADS='{bad}': expected a positive integer"):
            threads.safe_thread_count()
    with pytest.raises(ValueError, match="positive integer"):
        threads.set_thread_cap(0)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs numba with 2+ threads")
def test_kernels_run_with_the_cap_and_restore_numba(monkeypatch):
    seen = []
    monkeypatch.setattr(cpu_backend, "apply_token_bitmask_cpu", lambda *a: seen.append(numba.get_num_threads()))
    numba.set_num_threads(2)
    cpu = logitgate.get_backend("cpu")
    logits, bitmask = torch.zeros(2, 64), logitgate.allocate_token_bitmask(2, 64)
    threads.set_thread_cap(1)  # a loaded host's default
    logitgate.apply_token_bitmask_inplace(logits, bitmask, backend=cpu)
    threads.set_thread_cap(2)  # an explicit --threads 2 is not capped
    logitgate.apply_token_bitmask_inplace(logits, bitmask, backend=cpu)
    numba.set_num_threads(1)  # the caller's lower setting wins over the cap
    logitgate.apply_token_bitmask_inplace(logits, bitmask, backend=cpu)
    assert seen == [1, 2, 1]
    assert numba.get_num_threads() == 1
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_cap_is_decided_once_on_first_use(monkeypatch):
    threads.set_thread_cap(None)
    monkeypatch.setattr(threads, "safe_thread_count", lambda: 1)
    assert threads.thread_cap() == 1
    monkeypatch.setattr(threads, "safe_thread_count", lambda: 2)
    assert threads.thread_cap() == 1
