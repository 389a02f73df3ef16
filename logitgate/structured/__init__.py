"""Constraints -> per-row allowed sets and bitmasks."""
from .bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask_inplace,
    bitmask_from_token_ids,
    fill_bitmask_row,
    get_bitmask_shape,
    reset_token_bitmask,
    token_ids_from_bitmask,
)
from .tree import TreeDFA

__all__ = [
    "TreeDFA",
    "allocate_token_bitmask",
    "apply_token_bitmask_inplace",
    "bitmask_from_token_ids",
    "fill_bitmask_row",
    "get_bitmask_shape",
    "reset_token_bitmask",
    "token_ids_from_bitmask",
]
