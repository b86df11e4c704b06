"""Where the L local replicas meet for each collective.

Each replica deposits its contribution; the last one to arrive does the combining (and any MPI
work) while the others wait, so a collective costs one wake-up per waiting replica and no extra
hop. How a replica waits and is woken is the executor's business (:class:`Waits`): replica
threads sleep on a private lock (:class:`ThreadWaits`); cooperative greenlets switch back to
their scheduler (:mod:`.cooperative`). Everything else (deposits, combining, failures) is this
one piece of logic for both. Thread waits have a deadline: a replica that never arrives is named
in a CollectiveTimeoutError; a cooperative scheduler that finds no runnable replica calls
:meth:`Rendezvous.stall`, which reports the same error at once. When one replica fails, every
waiting replica is released at once with :class:`StepAborted` and later arrivals fail
immediately, so an exception can never leave the others hanging.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from popdist_py.engine.errors import CollectiveTimeoutError, StepAborted


class _Raise:
    """A result that is an error to raise in the woken replica (an abort, or a stall's timeout)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Waits(Protocol):
    """How a replica waits at the rendezvous and is woken: the executor's part of a collective."""

    def reset(self) -> None:
        """Forget wake-ups left over from an abandoned run."""

    def sleep(self, index: int, timeout: float, brief: bool = True) -> bool:
        """Block replica ``index`` until :meth:`wake` (True) or ``timeout`` seconds pass (False;
        ``inf``: no deadline). ``brief``: the wait should be short (a small collective)."""

    def wake(self, index: int) -> None:
        """Make replica ``index`` (asleep or about to sleep) return from :meth:`sleep`."""


#: How long a replica thread polls its lock, yielding the CPU between polls, before it sleeps on it.
#: A thread asleep in the kernel takes 15-25 us to run again on a virtual machine whose idle CPUs
#: halt (as this project's CI hosts do), which would be most of a small collective's time; one
#: that polls sees its wake-up within a few microseconds. The bound keeps a replica that waits for
#: a slow one from burning a core. Only where each replica thread has a core of its own: pollers
#: beyond the cores take them (and the GIL) from the replica that works (1 KiB all-reduce, 1 x 4
#: on 2 cores: 42 us without polling, 62 us with).
SPIN_SECONDS = 50e-6

#: The largest collective (bytes per replica) a waiting replica thread polls for. A larger one's
#: local work outlasts the poll, and a poller then holds the core that the combining replica's
#: slice threads need: the kernel puts a woken slice thread beside its waker while the other core
#: is busy, and leaves it there (64 MiB all-reduce, 1 x 2 on 2 cores: 2-8% slower with the poll).
POLL_BYTES = 1 << 20


_clock = time.perf_counter
_yield = os.sched_yield


class ThreadWaits:
    """Replica threads: each waits on its own lock, released by whoever wakes it; it polls the lock
    for ``poll`` seconds (``os.sched_yield`` between polls, which also hands over the GIL; 0: none)
    and then sleeps on it."""

    def __init__(self, size: int, poll: float = 0.0) -> None:
        self._poll = poll
        self._locks = [threading.Lock() for _ in range(size)]
        for lock in self._locks:
            lock.acquire()

    def reset(self) -> None:
        for lock in self._locks:
            lock.acquire(blocking=False)

    def sleep(self, index: int, timeout: float, brief: bool = True) -> bool:
        lock = self._locks[index]
        poll = min(self._poll, timeout) if brief else 0.0
        if poll > 0:
            end = _clock() + poll
            while not lock.acquire(False):
                if _clock() >= end:
                    break
                _yield()
            else:
                return True
        if math.isinf(timeout):
            return lock.acquire()
        return lock.acquire(timeout=timeout - poll)

    def wake(self, index: int) -> None:
        self._locks[index].release()


#: Deposit of a replica whose step has returned (it will not reach any further collective).
END = object()


class Rendezvous:
    """One meeting point for ``size`` replicas, reused for every collective of every run."""

    _deposits: list[Any]
    _results: list[Any]
    _waiting: list[bool]
    _count: int
    _failure: BaseException | None
    _failed_by: int | None

    def __init__(
        self,
        size: int,
        combine: Callable[[list[Any]], list[Any] | None],
        describe: Callable[[list[int]], str],
        describe_deposit: Callable[[Any], str],
        waits: Waits,
    ) -> None:
        """``combine(deposits)`` is run by the last arrival and returns one result per replica
        (or None); ``describe`` names replicas by index and ``describe_deposit`` names what a
        deposit is waiting in, for error messages. ``waits``: the executor's way of waiting
        (:class:`ThreadWaits` for replica threads)."""
        self.size = size
        self.combine = combine
        self.describe = describe
        self.describe_deposit = describe_deposit
        self._lock = threading.Lock()
        self._waits = waits
        self._sleep, self._wake = self._waits.sleep, self._waits.wake  # bound once: hot path
        self._gen = 0  # collectives completed: a waiter whose deadline passed tells "all arrived" by it
        self._forget()

    def reset(self) -> None:
        """Start a new run: forget deposits and any failure of the previous run."""
        with self._lock:
            self._forget()
            self._waits.reset()

    def _forget(self) -> None:
        self._deposits = [None] * self.size
        self._results = [None] * self.size
        self._waiting = [False] * self.size
        self._count = 0
        self._failure = None
        self._failed_by = None

    @property
    def waiting(self) -> int:
        """How many replicas wait in the current collective now: a failure raised after they do has
        to wake them, which is what the failure-release tests need to be sure of."""
        return sum(self._waiting)

    @property
    def failed(self) -> bool:
        return self._failure is not None

    @property
    def failure(self) -> BaseException | None:
        """The first failure of the current run (None while it has not failed)."""
        return self._failure

    @property
    def failed_by(self) -> int | None:
        """The local replica that raised :attr:`failure` (None while the run has not failed)."""
        return self._failed_by

    def arrive(self, index: int, deposit: Any, timeout: float, wait: bool = True, brief: bool = True) -> Any:
        """Deposit and, when last, run ``combine(deposits)``; return this replica's result.

        ``wait=False`` (a replica ending its step) returns at once unless it is the last to arrive;
        ``brief=False``: the combination takes long (a large collective), not worth polling for.
        """
        if self.size == 1:  # nobody to meet: no lock, no wake-ups
            if self._failure is not None:
                raise self._abort_error()
            try:
                results = self.combine([deposit])
            except BaseException as exc:
                self.fail(index, exc)
                raise
            return None if results is None else results[0]
        size = self.size
        with self._lock:
            if self._failure is not None:
                raise self._abort_error()
            deposits = self._deposits
            deposits[index] = deposit
            count = self._count + 1
            if count < size:
                self._count = count
                if not wait:
                    return None
                self._waiting[index] = True
                gen = self._gen
            else:
                self._deposits = [None] * size
                self._count = 0
                self._gen += 1
                gen = -1
        if gen >= 0:
            if not self._sleep(index, timeout, brief):
                return self._wait(index, gen, timeout, deposit)
            slots = self._results
            result = slots[index]
            slots[index] = None
            if type(result) is _Raise:
                raise result.error
            return result
        try:
            results = self.combine(deposits)
        except BaseException as exc:
            self.fail(index, exc)
            raise
        if results is None:
            return None
        with self._lock:
            waiting, slots, wake = self._waiting, self._results, self._wake
            for j in range(size):
                if waiting[j]:
                    slots[j] = results[j]
                    waiting[j] = False
                    wake(j)
        return results[index]

    def _wait(self, index: int, gen: int, timeout: float, deposit: Any) -> Any:
        """The first sleep timed out (threads only): released meanwhile, or a missing replica."""
        sleep = self._sleep
        wait_for = 0.0
        while not sleep(index, wait_for):
            with self._lock:
                if not self._waiting[index]:
                    continue  # released just now: the next sleep returns at once
                if self._gen != gen:
                    wait_for = math.inf  # everyone arrived; the combiner has its own deadlines
                    continue
                missing = [j for j in range(self.size) if self._deposits[j] is None]
                error = CollectiveTimeoutError(
                    f"{self.describe_deposit(deposit)}: {self.describe(missing)} did not arrive within {timeout:g} s "
                    f"(the other local replicas waited); set POPDIST_COLLECTIVE_TIMEOUT to wait longer"
                )
                self._waiting[index] = False
                self._fail_locked(index, error)
            raise error
        slots = self._results
        result = slots[index]
        slots[index] = None
        if type(result) is _Raise:
            raise result.error
        return result

    def stall(self) -> bool:
        """No local replica can run any more (cooperative executor) while some wait here.

        The waiting replicas can never be completed, so fail them now, exactly as a thread's
        timeout would, without waiting for the deadline: the first waiter gets a
        CollectiveTimeoutError naming the replicas that did not arrive, the others StepAborted.
        Returns whether any replica was waiting (and has been woken).
        """
        with self._lock:
            waiting = [j for j in range(self.size) if self._waiting[j]]
            if not waiting:
                return False
            first = waiting[0]
            # Replicas wait only while one has not arrived (once all have, the last one combines).
            missing = [j for j in range(self.size) if self._deposits[j] is None]
            what = self.describe_deposit(self._deposits[first])
            error = CollectiveTimeoutError(
                f"{what}: {self.describe(missing)} did not arrive and never will (no local replica was left "
                "to run under the cooperative executor; the others waited)"
            )
            self._waiting[first] = False
            self._results[first] = _Raise(error)
            self._wake(first)
            self._fail_locked(first, error)
        return True

    def fail(self, index: int, error: BaseException) -> None:
        """Replica ``index`` failed with ``error``: release every waiting replica with StepAborted."""
        with self._lock:
            self._fail_locked(index, error)

    def _fail_locked(self, index: int, error: BaseException) -> None:
        if self._failure is None:
            self._failure = error
            self._failed_by = index
        for j in range(self.size):
            if self._waiting[j]:
                self._results[j] = _Raise(self._abort_error())
                self._waiting[j] = False
                self._wake(j)

    def _abort_error(self) -> StepAborted:
        err, by = self._failure, self._failed_by
        assert by is not None  # recorded with the failure
        return StepAborted(f"step abandoned: {self.describe([by])} failed ({type(err).__name__}: {err})")
