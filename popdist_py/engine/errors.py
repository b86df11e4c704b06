"""The engine's errors: every exception of its own that a step, a collective or a checkpoint raises.

:class:`CollectiveError` (a RuntimeError) and its kinds :class:`CollectiveMismatchError` (also a
ValueError) and :class:`CollectiveTimeoutError` (also a TimeoutError) are shared with the host
collectives (:mod:`popdist_py.errors`); the engine adds its own kinds below. Besides these it
raises the builtin ValueError/TypeError for bad arguments and RuntimeError for misuse (a closed
runtime, ``Runtime.run`` inside a step).
"""

from __future__ import annotations

from popdist_py.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError


class StepAborted(CollectiveError):
    """Raised in a replica released from a collective because another replica's step failed.

    ``Runtime.run`` re-raises the original failure, not this one.
    """


class PeerAborted(CollectiveError):
    """Another instance abandoned its step (an exception there) while this one waited for it."""


class PeerClosed(PeerAborted):
    """Another instance closed its Runtime (or ended) while this one waited for it in a collective:
    a step there ended without the collective this instance is in."""


class InstancesDisagreeError(CollectiveMismatchError):
    """The instances disagreed about a collective (or about where the step ends).

    Raised on every instance at once (their signatures were compared), so they are still in step
    and the runtime remains usable, unlike after an error raised on one instance only.
    """


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the runtime; the message names the values."""


class PipelineStageError(RuntimeError):
    """A pipeline stage's forward or backward raised; the message names the replica, the stage, the
    forward or backward and the micro-batch (the stage's exception is chained as the cause)."""


__all__ = [
    "CheckpointError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "InstancesDisagreeError",
    "PeerAborted",
    "PeerClosed",
    "PipelineStageError",
    "StepAborted",
]
