"""poprun's own SIGINT, SIGTERM and SIGHUP outside a job (the supervisor records them while one
runs): the first ends poprun with 128 + its number, through the cleanup of whatever it is doing
(as Ctrl-C's KeyboardInterrupt would); any later one is swallowed, so that it cannot cut that
cleanup short. A cleanup that the first may not cut short either runs within ``Held``.

One that poprun was started with ignored stays ignored, by poprun and by the job it starts:
``nohup poprun ...`` outlives its terminal, and a shell's background job (``poprun ... &`` in a
script) is not ended by Ctrl-C meant for the shell, as for any other program.
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


#: Those of STOPPING that poprun acts on: not those it was started with ignored (see ``install``).
_heeded: tuple[int, ...] = STOPPING


def install() -> None:
    """From now on the first of STOPPING raises Interrupted, and later ones do nothing; one that
    was ignored when poprun started is left ignored."""
    global _heeded
    _heeded = tuple(sig for sig in STOPPING if _signal.getsignal(sig) != _signal.SIG_IGN)
    for sig in _heeded:
        _signal.signal(sig, _raise_once)


def heeded() -> tuple[int, ...]:
    """The signals of STOPPING that stop poprun (and, while a job runs, the job)."""
    return _heeded


def _raise_once(signum: int, _frame: object) -> None:
    for sig in _heeded:  # not SIG_IGN: a process started later would inherit that
        _signal.signal(sig, _swallow)
    raise Interrupted(signum)


def _swallow(_signum: int, _frame: object) -> None:
    pass


def ignore_for_good() -> None:
    """From now on STOPPING does nothing: poprun's status is settled and it is about to exit. A
    signal whose handler was about to run (a storm of them, one after the job's own) may still
    raise Interrupted once the swap begins; it is dropped here, not let out as a traceback."""
    while True:
        try:
            for sig in _heeded:
                _signal.signal(sig, _swallow)
            _signal.pthread_sigmask(_signal.SIG_BLOCK, STOPPING)
            return
        except Interrupted:
            continue  # its signal came after the status was settled; the handlers swallow from now


class Held:
    """Within, STOPPING is blocked; a signal that came meanwhile acts on leaving (or never, when
    poprun exits within).

    Python runs a signal's handler a few instructions after the signal arrives: one that arrived
    just before the block would still run inside it. So, within, the handlers only note the signal,
    and leaving raises it again, where the usual handlers act on it."""

    def __enter__(self) -> None:
        self.previous = _signal.pthread_sigmask(_signal.SIG_BLOCK, STOPPING)
        self.noted: int | None = None
        self.handlers = {sig: _signal.signal(sig, self._note) for sig in _heeded}

    def _note(self, signum: int, _frame: object) -> None:
        if self.noted is None:
            self.noted = signum

    def __exit__(self, *_: object) -> None:
        for sig, handler in self.handlers.items():
            _signal.signal(sig, handler)
        _signal.pthread_sigmask(_signal.SIG_SETMASK, self.previous)
        if self.noted is not None:
            _signal.raise_signal(self.noted)
