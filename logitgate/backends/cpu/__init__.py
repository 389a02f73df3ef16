"""The CPU backend (backend.py) and its numba kernels: bitmask apply, top-k/top-p and inverse-CDF
sampling, rejection sampling."""
from .backend import CpuBackend

__all__ = ["CpuBackend"]
