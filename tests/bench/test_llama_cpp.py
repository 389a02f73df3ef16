"""logitgate/bench/llama_cpp.py's thread settings: `default` leaves both of llama-cpp-python's thread
counts unset, `N` sets both, `N/M` each; anything else is refused naming the option. (The benchmark
itself runs by hand or in `logitgate bench`: docs/benchmarks.md has its command.)"""
import argparse

import pytest

from logitgate.bench.llama_cpp import main, thread_setting


def test_thread_settings():
    assert thread_setting("default") == ("default", None, None)
    assert thread_setting("1") == ("1", 1, 1)
    assert thread_setting("2/1") == ("2/1", 2, 1)
    for bad in ("0", "two", "1/0", "1/2/3", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--threads"):
            thread_setting(bad)


def test_help_names_both_thread_counts(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "n_threads_batch" in text and "--threads" in text and "load average" in text
