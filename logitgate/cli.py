"""Command line: `logitgate doctor | demo | bench | tree ...`."""
from __future__ import annotations

import argparse
import json
import sys

from .tree_cli import register as register_tree_commands


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import format_report, report

    data = report(args.device)
    print(json.dumps(data, indent=2) if args.json else format_report(data))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    # The end-to-end demo lands with the decode loop; until then the demo shows the device report
    # and one masked step so that `make demo` proves the install works.
    import torch

    from . import allocate_token_bitmask, apply_token_bitmask_inplace, fill_bitmask_row, get_backend
    from .doctor import format_report, report

    print(format_report(report(args.device)))
    backend = get_backend(args.device)
    vocab = 32000
    logits = torch.randn(2, vocab, device=backend.device)
    bitmask = allocate_token_bitmask(2, vocab, device=backend.device)
    fill_bitmask_row(bitmask, 0, [7, 42, 31999], vocab)
    apply_token_bitmask_inplace(logits, bitmask, backend=backend)
    print(f"\nmasked step on {backend.name}: row 0 argmax -> {int(logits[0].argmax())} (allowed: 7, 42, 31999); "
          f"row 1 unconstrained, {int(torch.isinf(logits[1]).sum())} tokens masked")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench_cli import format_table, run

    summary = run(args.out, args.only, quick=args.quick, device=args.device)
    print(format_table(summary))
    print(f"\nJSON and PNG per benchmark in {args.out}/")
    return 1 if any("error" in entry for entry in summary.values()) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="logitgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="versions, devices and the kernel each operation uses")
    doctor.add_argument("--device", default=None, help="cpu, cuda, npu or npu-emulated (default: detect)")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=_cmd_doctor)
    demo = sub.add_parser("demo", help="run the end-to-end demo")
    demo.add_argument("--device", default=None)
    demo.set_defaults(func=_cmd_demo)
    bench = sub.add_parser("bench", help="run the benchmark scripts, print one table of ratios")
    bench.add_argument("--out", default="bench-out", help="folder for JSON and PNG results")
    bench.add_argument("--only", nargs="*", help="benchmark names (bitmask, tree, sampling, ...)")
    bench.add_argument("--quick", action="store_true", help="fewer repeats and shapes")
    bench.add_argument("--device", default=None, help="LOGITGATE_DEVICE for the benchmarks")
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
