"""Checks for the plain values public functions take (ids, sizes, row numbers), shared so that every
boundary says the same thing: a float, a bool or a tensor is not an integer, even when int() would
quietly turn it into one (0.7 -> 0, True -> 1, 121.9 -> 121).

An integer is a Python int, an int subclass (an IntEnum of special tokens: `isinstance` and
`operator.index` call it an int) or a numpy integer (an id read from an array); never a bool,
Python's or numpy's, although bool subclasses int. Callers keep `int(value)`."""
from __future__ import annotations

import sys
from typing import Any

__all__ = ["as_index", "as_positive_int", "as_token_id", "is_integer", "is_integer_type", "short_repr"]


def is_integer(value: Any) -> bool:
    """A Python int (int subclasses included) or a numpy integer; not a bool, a float or a tensor."""
    return is_integer_type(type(value))


def is_integer_type(kind: type) -> bool:
    """Whether values of type `kind` are integers (is_integer): for checking a list's types at once.
    numpy is not imported for it (import-light modules check integers too): where numpy is not
    loaded, no value can be a numpy integer."""
    if issubclass(kind, bool):
        return False
    if issubclass(kind, int):
        return True
    numpy = sys.modules.get("numpy")
    return numpy is not None and issubclass(kind, numpy.integer)  # np.bool_ is no np.integer


def as_positive_int(value: Any, name: str) -> int:
    """`value` as an int > 0, else ValueError naming `name`."""
    if not is_integer(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def as_token_id(value: Any, vocab_size: int | None = None, where: str = "") -> int:
    """`value` as a token id in [0, vocab_size); ValueError "token id <value><where> ..." (where:
    e.g. " in row 3" or " of request 'a'")."""
    if not is_integer(value):
        raise ValueError(f"token id {short_repr(value)}{where} is not an integer")
    bound = vocab_size if vocab_size is not None else 2**31
    if not 0 <= value < bound:
        raise ValueError(f"token id {short_repr(value)}{where} is outside the vocabulary [0, {bound})")
    return int(value)


def as_index(value: Any, what: str, limit: int) -> int:
    """`value` as a row index in [0, limit); negative indices are not wrapped."""
    if not is_integer(value):
        raise ValueError(f"{what} {short_repr(value)} is not an integer")
    if not 0 <= value < limit:
        raise ValueError(f"{what} {short_repr(value)} is outside [0, {limit})")
    return int(value)


def short_repr(value: Any) -> str:
    """repr, cut short. A huge int is described, not printed: str() of one with more than 4300
    digits raises in Python >= 3.11."""
    if is_integer(value) and abs(int(value)) > 10**40:
        return f"<an integer of about {int(abs(int(value)).bit_length() * 0.30103) + 1} digits>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
