"""Errors shared by host collectives and the replica engine."""

from __future__ import annotations


class CollectiveError(RuntimeError):
    """A collective could not complete correctly."""


class CollectiveMismatchError(CollectiveError, ValueError):
    """Participants disagreed on shape, dtype, op or group; the message names them and their values."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """Some participants never arrived; the message names them (by instance and replica)."""
