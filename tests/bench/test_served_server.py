"""The one served-server lifecycle (logitgate/bench/served_server.py) on plain processes: the wait
fails with the server's output when it exits first, the stop reaches a whole process group, and a
group that has exited already is no error (the benchmark's old copy raised there)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from logitgate.bench.served_server import ServerExited, free_port, stop, wait_healthy


def test_a_server_that_exits_before_health_is_reported_with_its_output(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", "import sys; print('bad flag --nope'); sys.exit(3)"],
                                stdout=sink, stderr=subprocess.STDOUT)
    with pytest.raises(ServerExited, match=r"exited with 3 before it was healthy:\nbad flag --nope"):
        wait_healthy(proc, free_port(), timeout_s=30, log=log, poll_s=0.05)


def test_nothing_listening_is_a_timeout_naming_the_port():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    port = free_port()
    try:
        with pytest.raises(TimeoutError, match=f"port {port} not healthy after 0 s"):
            wait_healthy(proc, port, timeout_s=0.2, poll_s=0.05)
    finally:
        stop(proc)


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stop_reaches_the_group_even_when_its_leader_has_exited():
    """A server whose first process has exited while its workers run (the old benchmark copy checked
    the leader only and left the workers running); then, with the group gone, a stop is no error."""
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(p.pid, flush=True)")
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    worker = int(leader.stdout.readline())
    leader.wait()
    assert _alive(worker)
    stop(leader, group=True, grace_s=5)
    deadline = time.monotonic() + 5
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(worker):
        os.kill(worker, signal.SIGKILL)
        pytest.fail("the server's worker outlived the stop")
    stop(leader, group=True, grace_s=1)  # no ProcessLookupError
