"""Which variant of a CUDA kernel runs: LOGITGATE_CUDA_KERNELS (logitgate/envs.py).

Each of the three hot CUDA operations has two implementations kept side by side until a GPU run
decides between them (logitgate/bench/gpu_check/ times both in one process):

    bitmask    current: grid-stride programs, each unpacking 128 words into a (128, 32) mask and
               reshaping it, then a predicated store of -inf;
               v2: one tile per program, every lane shifting its own word, whole tiles skipped or
               stored without a read, vector load-select-store where many lanes are blocked.
    sampling   current: torch glue around torch.topk / the bisection kernel, (B, V) Exp(1) noise;
               v2: per-row Philox seeds instead of the noise tensor, a fused race-and-fallback
               kernel for random_sample, and with every row's top-k known on the host a two-kernel
               top-k / top-p / draw that reads the logits once.
    rejection  current: one program per request walking its rows; (B, V) noise;
               v2: a (row, vocabulary chunk) grid with a two-phase reduction, greedy and random
               requests in one pass, noise generated in the kernel for the rejected rows only.

The value is `current` or `v2` for every operation, or a comma list `op=variant` (operations not
named keep their default). The defaults are what the H200 run of 2026-11-26 measured faster
(docs/gpu-check.md): v2 for sampling (3.18x at top-k 50 / top-p 0.9, 1.15x at top-p alone) and
rejection (2.02x); current for the bitmask, which was faster on grammar-like masks (rows allowing
0.1% or 99.9% of the vocabulary: 15.3 vs 18.2 us at 64x128256), the masks grammars produce, while v2
was faster on random 50% masks (1.35-1.98x). It is read at every call (no restart needed, and a benchmark can switch
between calls); only backends/ consults it.
"""
from __future__ import annotations

import contextlib
import functools
import os

from .. import envs

ENV = "LOGITGATE_CUDA_KERNELS"
OPS = ("bitmask", "sampling", "rejection")
VARIANTS = ("current", "v2")
DEFAULTS = {"bitmask": "current", "sampling": "v2", "rejection": "v2"}  # measured: the module docstring


@functools.lru_cache(maxsize=16)
def parse(value: str | None) -> dict[str, str]:
    """op -> variant for every op, from the variable's text (None: DEFAULTS)."""
    chosen = dict(DEFAULTS)
    text = (value or "").strip()
    if not text:
        return chosen
    if "=" not in text:
        if text not in VARIANTS:
            raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(VARIANTS)} or op=variant pairs")
        return dict.fromkeys(OPS, text)
    for item in text.split(","):
        op, sep, variant = (part.strip() for part in item.partition("="))
        if not sep or op not in OPS or variant not in VARIANTS:
            raise ValueError(
                f"{ENV}={value!r}: {item.strip()!r} is not op=variant with op in {', '.join(OPS)} "
                f"and variant in {', '.join(VARIANTS)}"
            )
        chosen[op] = variant
    return chosen


def cuda_variant(op: str) -> str:
    """The variant of `op` (one of OPS) that runs now."""
    return parse(envs.read(ENV))[op]


@contextlib.contextmanager
def selected(op: str, variant: str):
    """Run the block with `op` on `variant` (LOGITGATE_CUDA_KERNELS set to op=variant, the other ops
    as they were), for benchmarks and tests that compare variants in one process."""
    parse(f"{op}={variant}")  # refuse an unknown op or variant before touching the environment
    old = envs.read(ENV)
    chosen = parse(old)
    os.environ[ENV] = ",".join(f"{name}={variant if name == op else chosen[name]}" for name in OPS)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old
