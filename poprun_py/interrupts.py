"""poprun's own SIGINT, SIGTERM and SIGHUP outside a job (the supervisor records them while one
runs): the first ends poprun with 128 + its number, through the cleanup of whatever it is doing
(as Ctrl-C's KeyboardInterrupt would); any later one is swallowed, so that it cannot cut that
cleanup short. A cleanup that the first may not cut short either runs within ``Held``.
"""

from __future__ import annotations

import _signal

#: The signals that ask poprun to stop.
STOPPING = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP)


class Interrupted(Exception):
    """One of STOPPING arrived while no job ran; poprun exits with 128 + ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def install() -> None:
    """From now on the first of STOPPING raises Interrupted, and later ones do nothing."""
    for sig in STOPPING:
        _signal.signal(sig, _raise_once)


def _raise_once(signum: int, _frame: object) -> None:
    for sig in STOPPING:  # not SIG_IGN: a process started later would inherit that
        _signal.signal(sig, _swallow)
    raise Interrupted(signum)


def _swallow(_signum: int, _frame: object) -> None:
    pass


class Held:
    """Within, STOPPING is blocked; a signal that came meanwhile acts on leaving (or never, when
    poprun exits within).

    Python runs a signal's handler a few instructions after the signal arrives: one that arrived
    just before the block would still run inside it. So, within, the handlers only note the signal,
    and leaving raises it again, where the usual handlers act on it."""

    def __enter__(self) -> None:
        self.previous = _signal.pthread_sigmask(_signal.SIG_BLOCK, STOPPING)
        self.noted: int | None = None
        self.handlers = {sig: _signal.signal(sig, self._note) for sig in STOPPING}

    def _note(self, signum: int, _frame: object) -> None:
        if self.noted is None:
            self.noted = signum

    def __exit__(self, *_: object) -> None:
        for sig, handler in self.handlers.items():
            _signal.signal(sig, handler)
        _signal.pthread_sigmask(_signal.SIG_SETMASK, self.previous)
        if self.noted is not None:
            _signal.raise_signal(self.noted)
