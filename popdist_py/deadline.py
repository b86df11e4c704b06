"""Waiting with a deadline: how long to wait for peers, and the one poll loop every wait uses.

A collective must never hang: every wait in popdist_py (and in the engine's transport) has a
deadline, ``POPDIST_COLLECTIVE_TIMEOUT`` seconds by default, and polls instead of blocking so
that it can give up and name who never arrived.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from popcontract import settings
from popcontract.environment import COLLECTIVE_TIMEOUT
from popdist_py.errors import CollectiveTimeoutError

DEFAULT_TIMEOUT = 600.0

#: Busy-poll this long before sleeping, then back off up to MAX_SLEEP between polls.
SPIN = 200e-6
FIRST_SLEEP = 20e-6
MAX_SLEEP = 1e-3

#: Names a participant (a rank of the communicator) in messages.
Describe = Callable[[int], str]


def describe_instance(rank: int) -> str:
    """The default name of a participant: the instance with that rank."""
    return f"instance {rank}"


def collective_timeout(timeout: float | None = None) -> float:
    """Seconds to wait for peers: ``timeout`` if given, else ``$POPDIST_COLLECTIVE_TIMEOUT``, else 600.

    ``inf`` means wait forever. Anything that is not a positive number raises ValueError.
    """
    if timeout is None:
        return settings.seconds(COLLECTIVE_TIMEOUT, DEFAULT_TIMEOUT)
    return settings.positive_seconds("timeout", timeout)


def poll(test: Callable[[], bool], deadline: float, *, spin: float = 0.0, yield_for: float = SPIN,
         first_sleep: float = FIRST_SLEEP, sleep: bool = True) -> bool:
    """Call ``test`` until it is true (True) or ``deadline`` (time.monotonic) passes (False).

    Busy-spins for ``spin`` seconds (most collectives complete within microseconds), then yields
    the core until ``yield_for`` seconds have passed (an oversubscribed peer may need it to
    arrive), then sleeps with exponential back-off so that a rank waiting for minutes does not
    burn a shared core. ``sleep=False`` never sleeps: for transfers that progress only while polled.
    """
    if test():
        return True
    now = time.monotonic()
    spin_end, yield_end = now + spin, now + yield_for
    delay = first_sleep
    while True:
        if test():
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        if now < spin_end:
            continue
        if now < yield_end or not sleep:
            os.sched_yield()
            continue
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, MAX_SLEEP)


def wait(
    request: Any,
    comm: Any,
    what: str,
    *,
    timeout: float | None = None,
    describe_rank: Describe | None = None,
) -> None:
    """Wait for an mpi4py Request (or a sequence of them) with :func:`agree`'s deadline semantics.

    A non-blocking collective cannot tell who is missing, so the timeout error names all the
    participants of ``comm``; call :func:`agree` first to have late ranks named precisely.
    """
    from mpi4py import MPI

    t = collective_timeout(timeout)
    if isinstance(request, MPI.Request):
        test: Callable[[], bool] = request.Test
    else:
        requests = list(request)

        def test() -> bool:
            return MPI.Request.Testall(requests)

    if poll(test, time.monotonic() + t):
        return
    describe = describe_rank or describe_instance
    names = ", ".join(describe(r) for r in range(comm.Get_size()))
    raise CollectiveTimeoutError(
        f"{what}: timed out after {t:g} s waiting for the collective over {names} to complete "
        f"(a participant never arrived); set {COLLECTIVE_TIMEOUT} to wait longer"
    )
