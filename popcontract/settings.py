"""Every setting popdist_py reads from the environment, read one way.

A variable that is unset or empty takes its default; one that is set to something unusable is an
error, :class:`PopdistEnvError` (a ``ValueError``), in one line naming the variable, its value and
what would be valid. The variables themselves are defined once, in ``popcontract.environment``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


class PopdistEnvError(ValueError):
    """A variable of the environment is malformed; the message names it, its value and what is valid."""


def _raw(name: str, env: Mapping[str, str] | None) -> str:
    return (os.environ if env is None else env).get(name, "")


def integer(name: str, default: int, minimum: int = 0, env: Mapping[str, str] | None = None) -> int:
    """``$name`` as a whole number of at least ``minimum``; ``default`` when unset or empty."""
    value = optional_integer(name, minimum, env)
    return default if value is None else value


def optional_integer(name: str, minimum: int = 0, env: Mapping[str, str] | None = None) -> int | None:
    """``$name`` as a whole number of at least ``minimum``; None when unset or empty."""
    raw = _raw(name, env)
    if not raw.strip():
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise PopdistEnvError(f"{name}={raw!r} is not an integer (use a whole number >= {minimum})") from None
    if value < minimum:
        raise PopdistEnvError(f"{name}={raw!r} must be >= {minimum}")
    return value


def choice(name: str, choices: tuple[str, ...], default: str, env: Mapping[str, str] | None = None) -> str:
    """``$name``, case and surrounding spaces ignored, as one of ``choices``; ``default`` when unset or empty."""
    raw = _raw(name, env)
    value = raw.strip().lower() or default
    if value not in choices:
        raise PopdistEnvError(f"{name}={raw!r} is not one of {', '.join(choices)}")
    return value


# --- The launcher's pass-through settings (added on branch options-plan; merge by hand) ---------


def given(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """``$name`` exactly as it is set, even empty, None when it is unset: a value poprun passes on
    to its instances unread (the user's ``OMP_NUM_THREADS``), or names folders or hosts by."""
    return (os.environ if env is None else env).get(name)


def passed(name: str, default: str, env: Mapping[str, str] | None = None) -> str:
    """``$name`` exactly as it is set, even empty, for poprun to pass on unread; ``default`` when unset."""
    value = given(name, env)
    return default if value is None else value
