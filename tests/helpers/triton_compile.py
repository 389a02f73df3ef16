"""Compiling Triton kernels for an H100/H200 (sm_90) on a host without a GPU, in a subprocess
without TRITON_INTERPRET (where triton.jit gives real kernels): the interpreter forgives what the
compiler does not (types of scalars and stores, broadcasting, constexpr branches, globals that are
not constexpr)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def compile_all(cases: Iterable[tuple]) -> dict[str, str]:
    """Compile every (kernel, signature, constexprs[, num_warps]) case: case id -> "ok" or the error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = {}
    for kernel, signature, constexprs, *warps in cases:
        case = f"{kernel.__name__} {next(iter(signature.values()))} {constexprs}" + (f" warps={warps[0]}" if warps else "")
        try:
            options = {"num_warps": warps[0]} if warps else None
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", 90, 32), options=options)
            ok = ".entry " + kernel.__name__ in compiled.asm["ptx"] and bool(compiled.asm["cubin"])  # ptxas accepted it
            results[case] = "ok" if ok else "no entry point or cubin"
        except Exception as exc:  # noqa: BLE001 - every case is reported
            results[case] = f"{type(exc).__name__}: {exc}"
    return results


def compile_in_subprocess(script: str | Path, cache_dir: Path) -> dict[str, str]:
    """Run `script` (which prints compile_all's result as JSON) with TRITON_INTERPRET unset and an
    empty Triton cache (really compile, not a cached binary)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)
