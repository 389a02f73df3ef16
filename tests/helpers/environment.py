"""What kind of Python environment the suite runs in."""
import importlib.metadata


def logitgate_installed() -> bool:
    """Whether logitgate is installed into this environment (`pip install -e .`, as `make test` sets
    up .venv, with requirements/tested-pins.txt as constraints), rather than run from a checkout on
    the machine's own packages (the GPU check's machines: no install, no entry points)."""
    try:
        importlib.metadata.distribution("logitgate")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
