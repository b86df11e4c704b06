"""Which instance failed first: the root cause of a failed job is the earliest failure in time over
all instances and hosts, not the first instance to exit.

An instance failed when its program ended by itself with a non-zero status, when it recorded an
error file (torch's ``@record``) before it was stopped, or when its stderr ended with an uncaught
exception's traceback as its stub came to stop it (``protocol.UNCAUGHT``: it was on its way out,
and the stop only cut that short). Its failure's time is the error file's own: torch records it in
whole seconds, and when the file was last written (read by its host's supervisor) refines it
within that second; else when its stub read the traceback's last line; else the time its program
ended. Each is the latest the failure can have happened, as close to it as its host could tell,
so the earliest of them failed first. Its host's clock offset (``clocks``) makes each a time on
poprun's clock. An instance's end that poprun (or its stub) caused by stopping it is never a
failure; only a failure that came before anything began to stop the instance (its record, its
traceback, or its end) can be the root cause: a program that ignores SIGTERM and then exits with a
status of its own failed too, but only after poprun's stop.

One refinement makes the usual torch failure come out right. The program that fails destroys its
process group in a ``finally``, which closes its connections, and records its error only after
that; its peers fail at once on the closed connections ("Connection closed by peer") and record
theirs first (by 10 to 40 ms with torch 2.13's gloo on one host). An error that came out of the
collectives (its traceback's innermost frame is in torch.distributed, COLLECTIVES) and whose message
says that a peer went away (PEER_LOST) is a consequence of another failure, so it counts
AFTERMATH_SECONDS later than it was recorded: a failure of another kind recorded up to that much
later came first. The words alone are not enough: a program's own code that raises on a connection
of its own (a data loader's socket reset by its server: ``ConnectionResetError``, "reset by peer")
failed by itself, and its peers' errors, recorded before its own, are the consequences. The root
cause's failure came before those it caused, so the time given for it is no later than theirs
(``Failed.no_later_than``): the failures' times run in their order. Imported only when a job has
failed.
"""

from __future__ import annotations

import datetime
from functools import cached_property

from poprun_py.shared.errors import printable_lines
from poprun_py.shared.root_cause import describe
from poprun_py.supervision.states import InstanceState

#: Words (compared in lower case) of a recorded error that say a peer went away: gloo's and torch's
#: ("Connection closed by peer", "Read error ...: Connection reset by peer", "This is typically
#: caused by a remote worker crashing"), a write to a closed connection, NCCL's "remote process
#: exited or there was a network error".
PEER_LOST = ("closed by peer", "reset by peer", "broken pipe", "remote worker", "remote process")
#: Where the innermost frame of an error raised in the collectives is (see above): torch.distributed,
#: whose calls gloo's and NCCL's errors come out of.
COLLECTIVES = ("/torch/distributed/",)
#: How much later than recorded an error that says a peer went away counts (see above): the program
#: that failed records its error after its clean-up, which took its peers down.
AFTERMATH_SECONDS = 1.0
#: The most characters of an error's first line shown on one summary line.
SHOWN_ERROR_CHARS = 200


class Failed:
    """One instance's failure: when (poprun's clock, seconds), what it recorded, if anything, and
    whether it came before anything stopped it (only such a failure can be the root cause)."""

    def __init__(self, state: InstanceState) -> None:
        self.state = state
        #: For the root cause: the earliest time among the other failures, when it is earlier than
        #: its own (they were recorded before it: see the module's docstring).
        self.no_later_than: float | None = None

    def _before_stop(self, ns: int) -> bool:
        """Whether ``ns`` (its host's clock) came before its stub began to stop it; without its
        stub's times (an older report), whether it failed by itself."""
        if not self.state.ended_ns:
            return self.state.failed_by_itself
        return bool(ns) and (not self.state.stopped_ns or ns < self.state.stopped_ns)

    @cached_property
    def recorded(self) -> dict[str, str | None] | None:
        """What its error file says (``root_cause.describe``), when it failed by itself or wrote
        the file before it was stopped."""
        state = self.state
        if state.root_cause is None or not (state.failed_by_itself or self._before_stop(state.recorded_ns)):
            return None
        return describe(state.root_cause)

    @cached_property
    def uncaught(self) -> str | None:
        """The uncaught exception's line its stderr ended with when it was stopped, when that is
        what tells its failure: it neither failed by itself nor recorded an error. Its supervisor looks
        only at what came before the stop: such a failure is always first-hand."""
        state = self.state
        if state.uncaught is None or state.failed_by_itself or self.recorded is not None:
            return None
        return state.uncaught

    @cached_property
    def first_hand(self) -> bool:
        """It failed before anything stopped it: by its error file's time, its uncaught exception,
        or its program's end."""
        state = self.state
        return (self.recorded is not None and self._before_stop(state.recorded_ns)) or \
            self.uncaught is not None or (state.failed_by_itself and self._before_stop(state.ended_ns))

    @property
    def at(self) -> float:
        """When it failed, on poprun's clock (seconds since the epoch)."""
        recorded = self.recorded_at()
        if recorded is not None:
            return recorded
        state = self.state
        if self.uncaught is not None:
            return (state.uncaught_ns - state.clock_offset) / 1e9
        if state.ended_ns:
            return (state.ended_ns - state.clock_offset) / 1e9
        assert state.seen_at is not None  # it has reported its end
        return state.seen_at

    def recorded_at(self) -> float | None:
        """Its error file's own time on poprun's clock: the second torch recorded, refined by when
        the file was written when that falls within that second."""
        if self.recorded is None:
            return None
        state = self.state
        written = state.recorded_ns / 1e9 if state.recorded_ns else None
        second = _whole(self.recorded["timestamp"])
        if second is not None and (written is None or not second <= written < second + 1):
            written = float(second)
        return None if written is None else written - state.clock_offset / 1e9

    @property
    def reported_at(self) -> float:
        """When it failed, as ``failures`` gives it: for the root cause, no later than the others."""
        return self.at if self.no_later_than is None else min(self.at, self.no_later_than)

    @property
    def peer_lost(self) -> bool:
        """Its recorded error came out of the collectives and says that a peer went away (a
        consequence of another failure); without a traceback, its words say so."""
        recorded = self.recorded or {}
        message = recorded.get("message") or ""
        if not any(words in message.lower() for words in PEER_LOST):
            return False
        return recorded.get("traceback") is None or raised_in_collectives(recorded["traceback"] or "")

    @property
    def rank(self) -> float:
        return self.at + (AFTERMATH_SECONDS if self.peer_lost else 0.0)

    @property
    def error(self) -> str | None:
        """The first line of its recorded error, else its uncaught exception's line, cut to
        SHOWN_ERROR_CHARS, ``printable``."""
        if self.recorded is not None:
            text: str | None = (self.recorded["message"] or "").strip()
        else:
            text = self.uncaught
        if text is None:
            return None
        first = printable_lines(text)[0] or "(no message)"
        return first if len(first) <= SHOWN_ERROR_CHARS else first[:SHOWN_ERROR_CHARS] + "..."

    def how(self) -> str:
        """How it failed: its status, or that it recorded its error (printed an uncaught
        exception) and then ended as it was stopped."""
        state = self.state
        status = state.how()
        if state.failed_by_itself or not self.first_hand:
            return status
        by = "poprun" if state.stopped_by_poprun else "its MPI launcher"
        what = "recorded its error" if self.recorded is not None else "printed an uncaught exception"
        return f"{what} at {clock(self.at)}, then ended as {by} stopped it: {status}"

    def report(self) -> dict[str, object]:
        """Its entry in --error-file's ``failures``."""
        from poprun_py.supervision.states import signal_name

        state = self.state
        return {"instance": state.index, "host": state.host, "status": state.status,
                "signal": signal_name(state.signal) if state.signal else None, "time": iso(self.reported_at),
                "error": self.error}


def failures(instances: list[InstanceState]) -> list[Failed]:
    """Every instance that failed: the first (see the module's docstring; on a tie, the lower
    index), then the others in the order they failed. One that failed only after it was told to
    stop (a program that ignores SIGTERM and then exits with a status of its own) is never the
    first. The first's time is bounded by the others' (``Failed.no_later_than``)."""
    found = [Failed(state) for state in instances if state.status]
    found = [failed for failed in found
             if failed.state.failed_by_itself or failed.recorded is not None or failed.uncaught is not None]
    if not found:
        return []
    first = min(found, key=lambda failed: (not failed.first_hand, failed.rank, failed.state.index))
    others = sorted((failed for failed in found if failed is not first),
                    key=lambda failed: (failed.at, failed.state.index))
    if others and others[0].at < first.at:
        first.no_later_than = others[0].at
    return [first, *others]


def raised_in_collectives(traceback: str) -> bool:
    """Whether a traceback's innermost frame (its last ``File "...", line N, in f``) is in the
    collectives' code (COLLECTIVES)."""
    frames = [line for line in traceback.splitlines() if line.lstrip().startswith('File "')]
    return bool(frames) and any(place in frames[-1] for place in COLLECTIVES)


def _whole(text: str | None) -> int | None:
    """torch's timestamp (whole seconds, as text), or None when there is none."""
    if text is None or not text.strip().isdigit():
        return None
    return int(text)


def clock(at: float) -> str:
    """A time of day as poprun shows it: local, to the millisecond."""
    return datetime.datetime.fromtimestamp(at).strftime("%H:%M:%S.%f")[:-3]


def iso(at: float) -> str:
    """A time as --error-file gives it: ISO 8601 in UTC."""
    return datetime.datetime.fromtimestamp(at, datetime.UTC).isoformat()
