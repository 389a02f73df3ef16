"""Build (or find in the cache) the json_writer model and measure how often its unconstrained output
is a valid record for each served-benchmark schema, greedy and at temperature 1.

    PYTHONPATH=$PWD python scripts/train_json_writer.py              # the cached model; trains it if absent
    PYTHONPATH=$PWD python scripts/train_json_writer.py --retrain    # train again (timed), without the cache
    PYTHONPATH=$PWD python scripts/train_json_writer.py --n 512 --out json_writer.json

Prints one JSON object: the model folder, the build's wall and CPU seconds and the load average
before and after (the host is shared), the training report (recipe.json), and per temperature the
fractions of `logitgate.models.json_writer_check.validity` over `--n` prompts made like vLLM's random
dataset (32 tokens, seed `--seed`).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--retrain", action="store_true", help="train again without reading or writing the cache")
    parser.add_argument("--n", type=int, default=256, help="prompts per temperature (default 256)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the prompts and the T=1 draws (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the measurement (default 1)")
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args(argv)

    import torch

    from logitgate.models.json_writer import Recipe, json_writer_model, train
    from logitgate.models.json_writer_check import load, validity
    from logitgate.models.random_prompts import random_prompts

    load_before, wall, cpu = os.getloadavg(), time.perf_counter(), cpu_seconds()
    if args.retrain:
        model, tokenizer, report = train(Recipe())
        path = None
    else:
        path = json_writer_model()
        model, tokenizer = load(path)
        report = json.loads((path / "recipe.json").read_text())
    result = {"path": str(path) if path else None, "build_wall_s": round(time.perf_counter() - wall, 1),
              "build_cpu_s": round(cpu_seconds() - cpu, 1), "load_before": [round(x, 2) for x in load_before],
              "load_after": [round(x, 2) for x in os.getloadavg()], "training": report}
    torch.set_num_threads(args.threads)
    prompts = random_prompts(tokenizer, args.n, seed=args.seed)
    for temperature in (0.0, 1.0):
        started = time.perf_counter()
        result[f"T={temperature:g}"] = validity(model, tokenizer, prompts, temperature, seed=args.seed)
        print(f"T={temperature:g}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as out:
            out.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
