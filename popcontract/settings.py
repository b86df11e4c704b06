"""Every setting poprun-py reads from the environment, read one way, by the library and the launcher.

A variable that is unset or empty takes its default; one that is set to something unusable is an
error, :class:`PopdistEnvError` (a ``ValueError``), in one line naming the variable, its value and
what would be valid. The variables themselves are defined once, in ``popcontract.environment``.
Every getter reads ``os.environ`` unless given another mapping (``env``: an environment that is
not this process's, such as a test's).

Copying the environment for a child, setting or removing a variable, and a PATH search are not
settings reads: they stay with ``os.environ``. The Python stub and the hosts' supervisors import
this module under ``python -S``: it imports ``os`` alone (``typing`` and ``collections`` would cost every launch).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing on the stubs' launch path
if TYPE_CHECKING:
    from collections.abc import Mapping


class PopdistEnvError(ValueError):
    """A variable of the environment is malformed; the message names it, its value and what is valid."""


def _raw(name: str, env: Mapping[str, str] | None) -> str:
    return (os.environ if env is None else env).get(name, "")


def given(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """``$name`` exactly as it is set, even empty; None when it is unset: for the variables poprun
    gives a value of its own only when the user has not set them (an empty value is the user's
    choice), and for values it passes on unread."""
    return (os.environ if env is None else env).get(name)


def passed(name: str, default: str, env: Mapping[str, str] | None = None) -> str:
    """``$name`` exactly as it is set, even empty, for poprun to pass on unread; ``default`` when unset."""
    value = given(name, env)
    return default if value is None else value


def text(name: str, default: str = "", env: Mapping[str, str] | None = None) -> str:
    """``$name`` as it is set (not stripped: a path may hold spaces); ``default`` when unset or empty."""
    return _raw(name, env) or default


def flag(name: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    """``$name`` as 1 (True) or 0 (False), surrounding spaces ignored; ``default`` when unset or empty."""
    raw = _raw(name, env)
    value = raw.strip()
    if value not in ("", "0", "1"):
        raise PopdistEnvError(f"{name}={raw!r} must be 0 or 1")
    return default if not value else value == "1"


def seconds(name: str, default: float, env: Mapping[str, str] | None = None) -> float:
    """``$name`` as a positive number of seconds, or ``inf`` (no limit); ``default`` when unset or empty."""
    raw = _raw(name, env)
    if not raw.strip():
        return default
    try:
        return positive_seconds(name, raw.strip())
    except ValueError as exc:
        raise PopdistEnvError(str(exc)) from None


def positive_seconds(source: str, value: object) -> float:
    """``value`` (a number, or its text) as a positive number of seconds or infinity; a ValueError
    naming ``source`` (the variable, or an argument) otherwise. One rule for a timeout however given."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = float(value)  # type: ignore[arg-type]  # anything float() refuses is refused below
    except (TypeError, ValueError):
        raise ValueError(f"{source}={value!r} is not a number of seconds (use a positive number or inf)") from None
    if number != number or number <= 0:  # nan fails every comparison
        raise ValueError(f"{source}={value!r} must be a positive number of seconds (or inf)")
    return number


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
