"""`python -m logitgate.bench.gpu_check`: the GPU check (main.py)."""
import sys

from .main import main

sys.exit(main())
