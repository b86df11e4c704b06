"""The one place where counts, indices and flags given to popdist_py are checked.

Every message names the argument, the value given and what would be valid. ``bool`` is refused
where a number belongs (it is an ``int`` subclass, and a flag passed as a count is a bug, not a
0 or 1). numpy integers are accepted and returned as plain ``int``. numpy is not imported here
(importing popdist_py stays cheap): a value can only be a numpy scalar once numpy is loaded.
"""

from __future__ import annotations

import numbers
import sys


def integer(name: str, value: object, minimum: int | None = None) -> int:
    """``value`` as an int, at least ``minimum`` when one is given."""
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} of type {type(value).__name__}")
    number = int(value)
    if minimum is not None and number < minimum:
        raise ValueError(f"{name}={number} is invalid: it must be an integer >= {minimum}")
    return number


def count(name: str, value: object) -> int:
    """A number of things: an integer >= 1."""
    return integer(name, value, 1)


def non_negative(name: str, value: object) -> int:
    """An offset or a size that may be empty: an integer >= 0."""
    return integer(name, value, 0)


def index(name: str, value: object, count_name: str, size: int) -> int:
    """An index into ``size`` things (``count_name`` says what they are): 0 <= value < size."""
    number = integer(name, value)
    if not 0 <= number < size:
        raise ValueError(f"{name}={number} is outside the valid range [0, {size - 1}] for {count_name}={size}")
    return number


def flag(name: str, value: object) -> bool:
    """True or False, nothing that merely converts to one."""
    if not _is_bool(value):
        raise TypeError(f"{name} must be True or False, got {value!r} of type {type(value).__name__}")
    return bool(value)


def _is_bool(value: object) -> bool:
    """A Python or a numpy bool."""
    numpy = sys.modules.get("numpy")
    return isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_))
