"""Starting and stopping vLLM's OpenAI-compatible server in tests: a free port on 127.0.0.1, the
wait for /health (failing with the server's stderr when it exits), the shutdown."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(server: subprocess.Popen, port: int | str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert server.poll() is None, f"server exited:\n{server.stderr.read()[-6000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(2)


def stop(server: subprocess.Popen, group: bool = False) -> None:
    """SIGTERM (to its process group when it was started in a session of its own), then SIGKILL."""
    def signal_it(sig):
        os.killpg(server.pid, sig) if group else server.send_signal(sig)

    signal_it(signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        signal_it(signal.SIGKILL)
        server.wait()
