"""Putting a test's inputs on the device of the backend under test.

Tests build their inputs on the CPU (from seeded CPU generators, so the values are the same on
every host) and hand them to each backend of the `backend` fixture; on a GPU run that includes
CUDA, whose public functions refuse CPU tensors ("tensor is on cpu but backend 'cuda' runs on
cuda:0"). `to_device` moves them, `on_backend_device` wraps a public function so that every call
moves its tensor arguments to the device of the `backend=` it is given."""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from logitgate.backends import get_backend


def to_device(value: Any, device: torch.device | str) -> Any:
    """`value` with every tensor in it (inside tuples, named tuples, lists and dicts too) on `device`; anything
    else (ints, None, generators) as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple (CandidateRows)
        return type(value)(*(to_device(v, device) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def on_backend_device(fn: Callable) -> Callable:
    """`fn` (a public function taking `backend=`), called with its tensor arguments on that
    backend's device; without `backend=` (or None), as given. Generators are not moved (a
    generator cannot change device and keep its state): tests make them on the device."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        backend = kwargs.get("backend")
        if backend is None:
            return fn(*args, **kwargs)
        device = get_backend(backend).device
        return fn(*to_device(args, device), **to_device(kwargs, device))

    return call
