"""Command line: `logitgate doctor | demo | bench | tree ...`."""
from __future__ import annotations

import argparse
import json
import sys

from .tree import register as register_tree_commands


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import format_report, report

    data = report(args.device)
    print(json.dumps(data, indent=2) if args.json else format_report(data))
    return 1 if "error" in data["backend"] else 0  # the requested device is unusable


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .demo_report import format_report

    # A line per phase on a terminal (stderr): never mixed into --json unless asked for.
    show = args.progress if args.progress is not None else (sys.stderr.isatty() and not args.json)
    data = run_demo(
        device=args.device, tree=args.tree, model=args.model, draft_model=args.draft_model,
        quick=args.quick, seed=args.seed, threads=args.threads,
        progress=(lambda line: print(line, file=sys.stderr, flush=True)) if show else None,
    )
    print(json.dumps(data, indent=2) if args.json else format_report(data))
    return 0 if data["check"]["ok"] else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import format_table, run, run_gpu_check

    if args.gpu:
        if args.only is not None:
            raise ValueError("--only does not apply to --gpu (the GPU check runs its fixed set)")
        return run_gpu_check(args.out, args.quick, args.device)
    out = args.out or "bench-out"
    summary = run(out, args.only, quick=args.quick, device=args.device)
    print(format_table(summary))
    print(f"\nJSON and PNG per benchmark, summary.json and summary.md in {out}/")
    return 1 if any("error" in entry for entry in summary.values()) else 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="logitgate", description=__doc__)
    parser.add_argument("--version", action="version", version=f"logitgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="versions, devices and the kernel each operation uses")
    doctor.add_argument("--device", default=None, help="cpu, cuda, npu, npu-emulated or npu-emulated-triton (default: detect)")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=_cmd_doctor)
    demo = sub.add_parser("demo", help="run the end-to-end demo (embedded model, or --model DIR)")
    demo.add_argument("--device", default=None, help="cpu, cuda, npu, npu-emulated or npu-emulated-triton (default: detect)")
    demo.add_argument("--tree", default=None, metavar="FILE", help="decode with this RTP-LLM prefix-dict JSON")
    demo.add_argument("--model", default=None, metavar="DIR", help="a local Hugging Face model + tokenizer directory")
    demo.add_argument("--draft-model", default=None, metavar="DIR", help="a draft model for --model (default: n-gram drafts)")
    demo.add_argument("--quick", action="store_true", help="fewer prompts")
    demo.add_argument("--seed", type=int, default=0, help="seed of the sampled runs")
    demo.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                      help="torch and numba threads (default: 1 for the embedded model; for --model the idle cores, "
                      "i.e. cores minus the load average, or LOGITGATE_THREADS)")
    demo.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                      help="a line per phase (loading, warm-up, each run) with timings on stderr "
                      "(default: on when stderr is a terminal and --json is not given)")
    demo.add_argument("--json", action="store_true", help="machine-readable output: the whole report as one object")
    demo.set_defaults(func=_cmd_demo)
    bench = sub.add_parser("bench", help="run the benchmarks (logitgate/bench/), print one table per benchmark")
    bench.add_argument("--out", default=None, help="folder for JSON and PNG results (default: bench-out; "
                       "with --gpu: gpu-check-out/<time>)")
    bench.add_argument("--only", nargs="*", metavar="NAME", help="benchmark names (an unknown one lists them all)")
    bench.add_argument("--quick", action="store_true", help="fewer repeats and shapes")
    bench.add_argument("--device", default=None, help="LOGITGATE_DEVICE for the benchmarks (--gpu: cuda, or cpu for a dry run)")
    bench.add_argument("--gpu", action="store_true", help="the GPU check (python -m logitgate.bench.gpu_check): tests, sync check, "
                       "CUDA benchmarks against xgrammar/vLLM baselines, JSON + markdown")
    bench.set_defaults(func=_cmd_bench)
    register_tree_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"logitgate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
