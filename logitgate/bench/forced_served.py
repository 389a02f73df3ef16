"""Forced drafts served (issue 37): the same requests on servers that differ only in forced drafts,
interleaved round by round, so one run compares them on one host's load.

    .venv-vllm/bin/python -m logitgate.bench.forced_served [--models json_writer,random] [--backends xgrammar]
        [--sides forced,whole,off,vllm] [--modes greedy,t1] [--drafts 8] [--rounds 2] [--prompts 128] [--ops OPS]
        [--speculative-config JSON] [--out FILE]

Each server is `python -m vllm.entrypoints.openai.api_server` with vLLM's defaults (logitgate.bench.vllm's
start_server and served_server_run: two warm-up rounds, then each case with vLLM's own benchmark
client, `--prompts` requests at concurrency 64, requests ending at the end token). The sides:

- `forced`: the plugin, forced drafts on (`LOGITGATE_VLLM_FORCED_DRAFTS=--drafts`), draft rows
  computed over the tokens their masks allow (forced/sparse.py);
- `whole`: the same with `LOGITGATE_VLLM_FORCED_SPARSE=0` (draft rows over the whole vocabulary);
- `off`: the plugin with forced drafts off (its default);
- `vllm`: vLLM alone (`VLLM_PLUGINS=`).

The cases: the same requests without a schema (the floor, greedy and T = 1), both served schemas in
each of `--modes`, then the floor again; the ratios take the floor's second run, and each server's
second run over its first (`after_over_first`) shows whether serving structured requests with the
feature left that server slower (a drift on one side only) or the host moved (every side). Per
case: the median output tokens/s of each side over the rounds, the ratios the issue's goals name
(forced over off, forced over vLLM alone, each side's structured throughput over its own floor, the
floor with forced on over off), the decode passes per output token (1 - accepted forced drafts /
output tokens) and the logits computed per draft row, from logitgate's counters. Needs an interpreter with vLLM (run it with .venv-vllm's python).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from logitgate.bench.vllm_engines import OPS_WITH_LOGITGATE

SIDES = ("forced", "whole", "off", "vllm")
MODES = ("greedy", "t1", "t1_seeded", "t1_top_p")


def side_env(side: str, drafts: int, ops: str = OPS_WITH_LOGITGATE) -> tuple[bool, dict[str, str]]:
    """(plugin loaded, environment over the server's) of a side; `ops`: the plugin's operations."""
    if side == "vllm":
        return False, {}
    if side == "off":
        return True, {"LOGITGATE_VLLM_FORCED_DRAFTS": "0", "LOGITGATE_VLLM_OPS": ops}
    env = {"LOGITGATE_VLLM_FORCED_DRAFTS": str(drafts), "LOGITGATE_VLLM_OPS": ops + ",forced",
           "LOGITGATE_VLLM_FORCED_SPARSE": "0" if side == "whole" else "1"}
    return True, env


FIRST = "_first"  # the floor's cases run again before the structured ones: `unconstrained_greedy_first`, ...


def cases_for(modes: list[str]) -> list[tuple[str, dict | None, str]]:
    """The floor first, both schemas in each mode, the floor again. The floor's second run is the
    one the ratios use (a server that has served structured requests, as a mixed server has); its
    first run tells what serving them did to it: the drift, after over first, on the same server."""
    from logitgate.bench.vllm import FLOOR_MODES
    from logitgate.models.json_records import SCHEMAS

    floor = [(f"unconstrained_{mode}", None, mode) for mode in FLOOR_MODES]
    cases = [(f"{schema}_{mode}", SCHEMAS[schema], mode) for schema in SCHEMAS for mode in modes]
    return [(name + FIRST, schema, mode) for name, schema, mode in floor] + cases + floor


def floor_drift(runs: dict[str, list[dict]], name: str) -> dict[str, list[float | None]]:
    """Per side, per server: the floor case `name`'s tokens/s after the structured cases over its
    tokens/s before them. A feature that leaves a server slower shows as a drift on its side only;
    the host's own swings move every side's."""
    def drift(run: dict) -> float | None:
        first = run.get(name + FIRST, {}).get("output_throughput")
        return round(run[name]["output_throughput"] / first, 2) if first else None

    return {side: [drift(run) for run in side_runs] for side, side_runs in runs.items()}


def passes_per_token(case: dict) -> float | None:
    """Decode passes per output token of one case on a server: 1 - accepted forced drafts / output tokens."""
    tokens = case.get("total_output_tokens")
    if not tokens:
        return None
    accepted = sum(v for k, v in case.get("logitgate_counts", {}).items() if k.startswith("forced_accepted_"))
    return round(1 - accepted / tokens, 3)


def logits_per_draft_row(case: dict) -> float | None:
    counts = case.get("logitgate_counts", {})
    rows = counts.get("forced_rows_sparse", 0) + counts.get("forced_rows_whole", 0)
    return round(counts.get("forced_logits_computed", 0) / rows, 1) if rows else None


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def summarize(model: str, backend: str, runs: dict[str, list[dict]], cases: list) -> list[dict]:
    """One row per case: each side's median tokens/s and the ratios between them."""
    rows = []
    for name, schema, mode in cases:
        tps = {side: _median([run[name]["output_throughput"] for run in side_runs]) for side, side_runs in runs.items()}
        floor_name = f"unconstrained_{mode if mode in ('greedy', 't1') else 't1'}"
        floor = {side: _median([run[floor_name]["output_throughput"] for run in side_runs]) for side, side_runs in runs.items()}
        row = {"model": model, "backend": backend, "case": name, "tokens_per_s": tps,
               "runs": {side: [round(run[name]["output_throughput"], 1) for run in side_runs] for side, side_runs in runs.items()},
               "valid": {side: [f"{run[name].get('valid')}/{run[name].get('completed')}" for run in side_runs]
                         for side, side_runs in runs.items()} if schema else None,
               "passes_per_token": {side: _median([passes_per_token(run[name]) for run in side_runs])
                                    for side, side_runs in runs.items() if side in ("forced", "whole")},
               "logits_per_draft_row": {side: _median([logits_per_draft_row(run[name]) for run in side_runs])
                                        for side, side_runs in runs.items() if side in ("forced", "whole")},
               # output tokens per engine step (vLLM's iteration count) per server: a server's batches
               # on this 2-core host now and then run at half the size for a whole case, on either side
               "tokens_per_step": {side: [round(run[name]["total_output_tokens"] / run[name]["engine_steps"], 1)
                                          if run[name].get("engine_steps") else None for run in side_runs]
                                   for side, side_runs in runs.items()},
               "errors": [e for side_runs in runs.values() for run in side_runs for e in run[name].get("errors", [])][:3]}
        ratio = {}
        for a, b in (("forced", "off"), ("forced", "vllm"), ("whole", "off"), ("forced", "whole"), ("off", "vllm")):
            if tps.get(a) and tps.get(b):
                ratio[f"{a}/{b}"] = round(tps[a] / tps[b], 2)
        row["ratios"] = ratio
        if schema:
            row["of_floor"] = {side: round(tps[side] / floor[side], 2) for side in tps if tps[side] and floor.get(side)}
        elif not name.endswith(FIRST):
            row["after_over_first"] = floor_drift(runs, name)
        rows.append(row)
    return rows


def run(models: list[str], backends: list[str], sides: list[str], modes: list[str], drafts: int, rounds: int,
        prompts: int, port: int = 8123, ops: str = OPS_WITH_LOGITGATE, speculative_config: str | None = None) -> dict:
    from logitgate.bench.vllm import served_model, served_server_run

    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    cases = cases_for(modes)
    extra_args = ["--speculative-config", speculative_config] if speculative_config else None
    rows, identical = [], {}
    for model in models:
        path = served_model(model)
        for backend in backends:
            runs: dict[str, list[dict]] = {side: [] for side in sides}
            for r in range(rounds):
                for side in sides:
                    with_logitgate, env = side_env(side, drafts, ops)
                    log = logs / f"bench_forced_served_{model}_{backend}_{side}_{r}.log"
                    result = served_server_run(sys.executable, path, with_logitgate, port, log, backend, env, cases,
                                               prompts, extra_args)
                    runs[side].append(result)
                    brief = {name: {k: v for k, v in case.items() if k != "texts"} if isinstance(case, dict) else case
                             for name, case in result.items()}
                    print(f"SERVER_RUN {model} {backend} {side} {r} {json.dumps(brief)}", file=sys.stderr, flush=True)
            rows += summarize(model, backend, runs, cases)
            greedy = [name for name, _, mode in cases if mode == "greedy"]
            first = runs[sides[0]][0]
            identical[f"{model}/{backend}"] = {name: all(run[name]["texts"] == first[name]["texts"]
                                                         for side_runs in runs.values() for run in side_runs)
                                               for name in greedy}
    return {"benchmark": "forced_served", "drafts": drafts, "rounds": rounds, "prompts": prompts, "ops": ops,
            "speculative_config": speculative_config, "sides": sides, "rows": rows,
            "greedy_identical": identical}


def main(argv: list[str] | None = None) -> dict:
    from logitgate.bench.vllm import SERVED_BACKENDS, SERVED_MODELS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="json_writer", help=f"comma list of {', '.join(SERVED_MODELS)}")
    parser.add_argument("--backends", default="xgrammar", help=f"comma list of {', '.join(SERVED_BACKENDS)}")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma list of {', '.join(SIDES)}")
    parser.add_argument("--modes", default="greedy,t1", help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--drafts", type=int, default=8, help="forced tokens a request may propose a step")
    parser.add_argument("--rounds", type=int, default=2, help="servers per side (interleaved)")
    parser.add_argument("--prompts", type=int, default=128, help="requests per case (at concurrency 64)")
    parser.add_argument("--ops", default=OPS_WITH_LOGITGATE,
                        help="the plugin's operations on its sides (LOGITGATE_VLLM_OPS; `forced` is added on the "
                             "forced sides), e.g. without sample_first for the path of hosts where it is off (GPU, NPU)")
    parser.add_argument("--speculative-config", metavar="JSON",
                        help="a user's drafter on every server (vLLM's --speculative-config, e.g. "
                             "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3, \"prompt_lookup_max\": 3}'): "
                             "forced drafts replace the drafter's where the grammar fixes tokens (item d of issue 37)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    def listed(text: str, allowed, what: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items or set(items) - set(allowed):
            parser.error(f"--{what}: {text!r}; choose from {', '.join(allowed)}")
        return items

    models = listed(args.models, SERVED_MODELS, "models")
    backends = listed(args.backends, SERVED_BACKENDS, "backends")
    sides = listed(args.sides, SIDES, "sides")
    modes = listed(args.modes, MODES, "modes")
    if args.drafts < 1 or args.rounds < 1 or args.prompts < 1:
        parser.error("--drafts, --rounds and --prompts: at least 1")
    if args.speculative_config:
        try:
            json.loads(args.speculative_config)
        except ValueError as exc:
            parser.error(f"--speculative-config is not JSON: {exc}")
    from logitgate.bench.harness import emit

    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        result = {"benchmark": "forced_served", "skipped": f"no vLLM in {sys.executable}: {exc}", "rows": []}
        emit(result, args.out)
        return result
    result = run(models, backends, sides, modes, args.drafts, args.rounds, args.prompts, ops=args.ops,
                 speculative_config=args.speculative_config)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
