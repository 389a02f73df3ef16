"""Triton kernels shared by the CUDA and Ascend (triton-ascend) backends.

Importing this package requires triton; backends import it lazily and only when triton imports.
CI runs these kernels on CPU tensors with TRITON_INTERPRET=1.
"""
