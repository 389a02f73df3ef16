"""Every environment variable logitgate reads, in one table.

    variable                            type                      default                      meaning
    LOGITGATE_DEVICE                    device name               best found (cuda, npu, cpu)  the backend used when none is given (cpu, cuda, npu, npu-emulated, npu-emulated-triton)
    LOGITGATE_THREADS                   int >= 1                  idle cores (cores - load)    CPU kernel threads (numba, torch)
    LOGITGATE_CACHE                     path                      ~/.cache/logitgate           cache of tokenizer vocabularies, test GGUF models and the json_writer model
    LOGITGATE_XGRAMMAR_CACHE_MB         int MB, -1                512                          bound of xgrammar's compiled-grammar cache (-1: unbounded)
    LOGITGATE_TREE_MAX_BYTES            int >= 1                  134217728 (128 MiB)          JSON text of one tree
    LOGITGATE_TREE_MAX_NODES            int >= 1                  16777216                     nodes of one tree: the root, and a node per token of a sequence or per key of a prefix dict
    LOGITGATE_TREE_MAX_DEPTH            int >= 1                  65536                        tokens along one path of a tree
    LOGITGATE_TREE_CACHE_BYTES          int >= 0                  268435456 (256 MiB)          bytes of compiled trees kept for reuse (0: none)
    LOGITGATE_TREE_SPARSE_MAX_FRACTION  float [0, 1]              0.5                          rows allowing more of the vocabulary are sampled densely
    LOGITGATE_TREE_DIR                  path                      unset (no named trees)       directory of the tree files requests may name (vLLM)
    LOGITGATE_TREE_DECODE_CONFIG        path                      unset (no server tree)       prefix-dict file applied to every request without a tree (vLLM)
    LOGITGATE_VLLM_OPS                  comma list                all                          what the vLLM plugin takes over: bitmask, sampler, rejection, fill, sample_first, tree, forced; none
    LOGITGATE_VLLM_DEVICES              comma list                cpu                          device types whose vLLM calls run on logitgate's kernels (cpu, cuda, npu)
    LOGITGATE_VLLM_SEEDED               vllm, logitgate           vllm                         who draws seeded rows and fp64-Gumbel calls in vLLM (vllm: the tokens vLLM gives per seed)
    LOGITGATE_VLLM_FORCED_DRAFTS        int >= 0                  0 (off)                      vLLM: most tokens a request's constraint fixes that are proposed as drafts per step (0: none)
    LOGITGATE_VLLM_FORCED_SPARSE        0, 1                      1                            vLLM: forced drafts' logits computed over the tokens their masks allow (0: whole rows)
    LOGITGATE_VLLM_METRICS_DIR          path                      set by the plugin            where a vLLM server's processes leave logitgate's counters for /metrics (not for operators)
    LOGITGATE_CUDA_KERNELS              variant, op=variant list  sampling, rejection v2       CUDA kernel variant per op: current or v2, for all (v2) or per op (bitmask=v2,sampling=current,rejection=v2)
    LOGITGATE_VLLM_PYTHON               path                      this interpreter             the vLLM benchmarks (logitgate.bench.vllm, .tree_admission_stall): the interpreter with a vLLM engine
    LOGITGATE_GPU_SITE                  path                      set by the script            the GPU check: its package directory, for its child processes

Each variable is read when it is used, never cached at import (the vLLM settings are parsed once
per distinct value), so setting one takes effect at the next call. Malformed values are refused by
the module that uses them, with an error naming the variable (column "owner" of VARIABLES).
`logitgate doctor` lists the variables that are set, and names a set LOGITGATE_* variable that is
none of these (a typo would otherwise be ignored).

Only the standard library here: vLLM loads the plugin, which reads these, before its workers start.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["PREFIX", "VARIABLES", "Variable", "read", "set_variables", "table", "unknown_variables"]

PREFIX = "LOGITGATE_"


@dataclass(frozen=True)
class Variable:
    name: str
    type: str  # what a value looks like
    default: str  # what applies when unset, in words
    meaning: str
    owner: str  # the module that parses and validates it


def _declare(*variables: Variable) -> dict[str, Variable]:
    return {v.name: v for v in variables}


VARIABLES: dict[str, Variable] = _declare(
    Variable("LOGITGATE_DEVICE", "device name", "best found (cuda, npu, cpu)",
             "the backend used when none is given (cpu, cuda, npu, npu-emulated, npu-emulated-triton)", "logitgate.backends"),
    Variable("LOGITGATE_THREADS", "int >= 1", "idle cores (cores - load)",
             "CPU kernel threads (numba, torch)", "logitgate.backends.cpu.threads"),
    Variable("LOGITGATE_CACHE", "path", "~/.cache/logitgate",
             "cache of tokenizer vocabularies, test GGUF models and the json_writer model", "logitgate.models.real_vocab"),
    Variable("LOGITGATE_XGRAMMAR_CACHE_MB", "int MB, -1", "512",
             "bound of xgrammar's compiled-grammar cache (-1: unbounded)", "logitgate.structured.xgrammar_backend"),
    Variable("LOGITGATE_TREE_MAX_BYTES", "int >= 1", "134217728 (128 MiB)",
             "JSON text of one tree", "logitgate.structured.tree.limits"),
    Variable("LOGITGATE_TREE_MAX_NODES", "int >= 1", "16777216",
             "nodes of one tree: the root, and a node per token of a sequence or per key of a prefix dict", "logitgate.structured.tree.limits"),
    Variable("LOGITGATE_TREE_MAX_DEPTH", "int >= 1", "65536",
             "tokens along one path of a tree", "logitgate.structured.tree.limits"),
    Variable("LOGITGATE_TREE_CACHE_BYTES", "int >= 0", "268435456 (256 MiB)",
             "bytes of compiled trees kept for reuse (0: none)", "logitgate.structured.tree.limits"),
    Variable("LOGITGATE_TREE_SPARSE_MAX_FRACTION", "float [0, 1]", "0.5",
             "rows allowing more of the vocabulary are sampled densely", "logitgate.structured.tree.candidates"),
    Variable("LOGITGATE_TREE_DIR", "path", "unset (no named trees)",
             "directory of the tree files requests may name (vLLM)", "logitgate.integrations.vllm.tree.args"),
    Variable("LOGITGATE_TREE_DECODE_CONFIG", "path", "unset (no server tree)",
             "prefix-dict file applied to every request without a tree (vLLM)", "logitgate.integrations.vllm.tree.args"),
    Variable("LOGITGATE_VLLM_OPS", "comma list", "all",
             "what the vLLM plugin takes over: bitmask, sampler, rejection, fill, sample_first, tree, forced; none",
             "logitgate.integrations.vllm.plugin"),
    Variable("LOGITGATE_VLLM_DEVICES", "comma list", "cpu",
             "device types whose vLLM calls run on logitgate's kernels (cpu, cuda, npu)",
             "logitgate.integrations.vllm.kernel_replacements"),
    Variable("LOGITGATE_VLLM_SEEDED", "vllm, logitgate", "vllm",
             "who draws seeded rows and fp64-Gumbel calls in vLLM (vllm: the tokens vLLM gives per seed)", "logitgate.integrations.vllm.kernel_replacements"),
    Variable("LOGITGATE_VLLM_FORCED_DRAFTS", "int >= 0", "0 (off)",
             "vLLM: most tokens a request's constraint fixes that are proposed as drafts per step (0: none)",
             "logitgate.integrations.vllm.forced"),
    Variable("LOGITGATE_VLLM_FORCED_SPARSE", "0, 1", "1",
             "vLLM: forced drafts' logits computed over the tokens their masks allow (0: whole rows)",
             "logitgate.integrations.vllm.forced.sparse"),
    Variable("LOGITGATE_VLLM_METRICS_DIR", "path", "set by the plugin",
             "where a vLLM server's processes leave logitgate's counters for /metrics (not for operators)",
             "logitgate.integrations.vllm.metrics"),
    Variable("LOGITGATE_CUDA_KERNELS", "variant, op=variant list", "sampling, rejection v2",
             "CUDA kernel variant per op: current or v2, for all (v2) or per op (bitmask=v2,sampling=current,rejection=v2)",
             "logitgate.backends.variants"),
    Variable("LOGITGATE_VLLM_PYTHON", "path", "this interpreter",
             "the vLLM benchmarks (logitgate.bench.vllm, .tree_admission_stall): the interpreter with a vLLM engine",
             "logitgate.bench.vllm"),
    Variable("LOGITGATE_GPU_SITE", "path", "set by the script",
             "the GPU check: its package directory, for its child processes", "logitgate.bench.gpu_check.wheels"),
)


def read(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The text of variable `name` now (None when unset), from `environ` (default: os.environ).
    KeyError for a name not declared above, so a misspelt read fails in tests, not in production."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a declared logitgate environment variable (logitgate/envs.py)")
    return (os.environ if environ is None else environ).get(name)


def table() -> str:
    """VARIABLES as the aligned text table of this module's docstring."""
    rows = [("variable", "type", "default", "meaning")] + [(v.name, v.type, v.default, v.meaning) for v in VARIABLES.values()]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in rows)


def set_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The declared variables that are set, in table order."""
    env = os.environ if environ is None else environ
    return {name: env[name] for name in VARIABLES if name in env}


def unknown_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Set LOGITGATE_* variables that logitgate does not read (a typo, or one from another version)."""
    env = os.environ if environ is None else environ
    return {name: value for name, value in sorted(env.items()) if name.startswith(PREFIX) and name not in VARIABLES}


if __name__ == "__main__":  # python -m logitgate.envs: the table of the docstring
    print(table())
