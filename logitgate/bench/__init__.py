"""The benchmark harness, shipped in the package (as vLLM ships `vllm/benchmarks/`), loaded only on use.

harness.py (timing, progress, JSON and plots every benchmark shares), vllm_engines.py (the real vLLM
engines, models and requests the vLLM benchmark and the engine tests share), served_server.py (one
`vllm serve` lifecycle: start, wait until healthy, stop), the kernel benchmarks (one module each,
`python -m logitgate.bench.<name>`, and `logitgate bench`), gpu_check/ (the GPU check, one module
per job: `python -m logitgate.bench.gpu_check`). It sits between integrations/ and cli/: the
commands drive it, it drives everything below."""
from __future__ import annotations

from ..lazy import lazy_exports

# The benchmarks `logitgate bench` runs, each a module here run as `python -m logitgate.bench.NAME`.
BENCHMARKS = ("bitmask", "llama_cpp", "rejection", "sampling", "structured", "threads", "tree", "tree_compile", "vllm")

_EXPORTS = {
    "Progress": ".harness",
    "Timing": ".harness",
    "emit": ".harness",
    "plot_bars": ".harness",
    "round_robin": ".harness",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
