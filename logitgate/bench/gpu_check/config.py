"""The GPU check's shapes (CUDA, and the CPU dry run's small ones) and goals, and where it runs from."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]  # the checkout (or site folder) this logitgate is imported from

# Goals (issue 14), evaluated on CUDA only.
GOAL_COPY_FRACTION = 0.80
GOAL_FLOOR_RATIO = 1.5

SHAPES = {
    "cuda": {
        "bitmask": [(64, 128256), (256, 151936)],
        "bitmask_grammar": (64, 128256),
        "sampling": (64, 128256),
        "rejection": (64, 4, 128256),
        "tree": (64, 128256, 20000),
        "noise": (256, 151936),
    },
    "cpu": {  # the dry run: small enough for a CI test
        "bitmask": [(4, 4096), (8, 8192)],
        "bitmask_grammar": (4, 8192),
        "sampling": (8, 8192),
        "rejection": (4, 4, 4096),
        "tree": (8, 8192, 500),
        "noise": (8, 8192),
    },
}
