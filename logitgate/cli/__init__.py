"""The command line: `logitgate doctor | demo | bench | tree ...` and their report formatting.

main.py parses arguments and dispatches; each command's work lives in its own module (demo.py and
demo_report.py, bench.py over logitgate/bench/, doctor.py, tree.py)."""
from .main import build_parser, main

__all__ = ["build_parser", "main"]
