"""Connections to the control port that poprun refuses, said in a bounded number of lines.

Whoever can reach the port can connect (any local process on a one-host job, any host on the
network otherwise): one line per refused connection would let them flood poprun's stderr. The first
is said in full (from where, why); the ones after it are counted and said as one line at most
every REPORT_SECONDS, and once more at the end of the job if some are not yet said. After a quiet
REPORT_SECONDS the next is said in full again. With -vv each is said in full (a debug line).
"""

from __future__ import annotations

import time

from poprun_py.supervision import log

#: The shortest time between two lines about refused connections.
REPORT_SECONDS = 5.0


class Strays:
    """The refused connections of one start of the job, and when they were last said."""

    def __init__(self) -> None:
        self.said_at: float | None = None  # time.monotonic() of the last line
        self.unsaid = 0  # refused since that line
        self.last = ""  # the last of them: from where, why

    def refused(self, peer: str, why: str) -> None:
        """The connection from ``peer`` was closed for ``why``."""
        now = time.monotonic()
        if self.said_at is None or (not self.unsaid and now - self.said_at >= REPORT_SECONDS):
            log.error("unexpected connection on the control port from %s: %s", peer, why)
            self.said_at = now
            return
        self.unsaid += 1
        self.last = f"{peer}: {why}"
        log.debug("unexpected connection on the control port from %s: %s", peer, why)  # each, with -vv

    def tick(self) -> None:
        """Say the count once REPORT_SECONDS have passed since the last line."""
        if self.unsaid and self.said_at is not None and time.monotonic() - self.said_at >= REPORT_SECONDS:
            self.finish()

    def finish(self) -> None:
        """Say the count of those not yet said (the job is over)."""
        if not self.unsaid or self.said_at is None:
            return
        now = time.monotonic()
        log.error("refused %d more connection(s) on the control port in the last %g s (the last from %s)",
                  self.unsaid, round(now - self.said_at, 1), self.last)
        self.said_at = now
        self.unsaid = 0
