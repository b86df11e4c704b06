"""Where the L local replica threads meet for each collective.

Each replica deposits its contribution; the last one to arrive does the combining (and any MPI
work) in its own thread while the others sleep on a private lock, so a collective costs one
wake-up per waiting replica and no extra thread hop. Waits have a deadline: a replica that never
arrives is named in a CollectiveTimeoutError. When one replica fails, every waiting replica is
released at once with :class:`StepAborted` and later arrivals fail immediately, so an exception
can never leave the others hanging.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from popdist_py.errors import CollectiveError, CollectiveTimeoutError


class StepAborted(CollectiveError):
    """Raised in a replica released from a collective because another replica's step failed.

    ``Runtime.run`` re-raises the original failure, not this one.
    """


class _Aborted:
    __slots__ = ("error",)

    def __init__(self, error: StepAborted) -> None:
        self.error = error


#: Deposit of a replica whose step has returned (it will not reach any further collective).
END = object()


class Rendezvous:
    """One meeting point for ``size`` replicas, reused for every collective of every run."""

    def __init__(
        self,
        size: int,
        combine: Callable[[list[Any], int], list[Any] | None],
        describe: Callable[[list[int]], str],
        describe_deposit: Callable[[Any], str],
    ) -> None:
        """``combine(deposits, index)`` is run by the last arrival (``index``) and returns one
        result per replica (or None); ``describe`` names replicas by index and
        ``describe_deposit`` names what a deposit is waiting in, for error messages."""
        self.size = size
        self.combine = combine
        self.describe = describe
        self.describe_deposit = describe_deposit
        self._lock = threading.Lock()
        self._sems = [threading.Lock() for _ in range(size)]
        for s in self._sems:
            s.acquire()
        self._waiting = [False] * size
        self._results: list[Any] = [None] * size
        self._deposits: list[Any] = [None] * size
        self._count = 0
        self._gen = 0
        self._failure: BaseException | None = None
        self._failed_by: int | None = None

    def reset(self) -> None:
        """Start a new run: forget deposits and any failure of the previous run."""
        with self._lock:
            self._deposits = [None] * self.size
            self._results = [None] * self.size
            self._waiting = [False] * self.size
            self._count = 0
            self._gen += 1
            self._failure = None
            self._failed_by = None
            for s in self._sems:
                s.acquire(blocking=False)

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def arrive(self, index: int, deposit: Any, timeout: float, wait: bool = True) -> Any:
        """Deposit and, when last, run ``combine(deposits, index)``; return this replica's result.

        ``wait=False`` (a replica ending its step) returns at once unless it is the last to arrive.
        """
        if self.size == 1:  # nobody to meet: no lock, no wake-ups
            if self._failure is not None:
                raise self._abort_error()
            try:
                results = self.combine([deposit], 0)
            except BaseException as exc:
                self.fail(index, exc)
                raise
            return None if results is None else results[0]
        with self._lock:
            if self._failure is not None:
                raise self._abort_error()
            self._deposits[index] = deposit
            self._count += 1
            if self._count < self.size:
                if not wait:
                    return None
                self._waiting[index] = True
                gen = self._gen
                last = False
            else:
                deposits = self._deposits
                self._deposits = [None] * self.size
                self._count = 0
                self._gen += 1
                last = True
        if not last:
            return self._wait(index, gen, timeout, deposit)
        try:
            results = self.combine(deposits, index)
        except BaseException as exc:
            self.fail(index, exc)
            raise
        if results is None:
            return None
        with self._lock:
            for j in range(self.size):
                if self._waiting[j]:
                    self._results[j] = results[j]
                    self._waiting[j] = False
                    self._sems[j].release()
        return results[index]

    def _wait(self, index: int, gen: int, timeout: float, deposit: Any) -> Any:
        sem = self._sems[index]
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if math.isinf(remaining):
                acquired = sem.acquire()
            else:
                acquired = sem.acquire(timeout=max(remaining, 0.0))
            if acquired:
                break
            with self._lock:
                if not self._waiting[index]:
                    continue  # released just now: the next acquire succeeds at once
                if self._gen != gen:
                    deadline = math.inf  # everyone arrived; the combiner has its own deadlines
                    continue
                missing = [j for j in range(self.size) if self._deposits[j] is None]
                error = CollectiveTimeoutError(
                    f"{self.describe_deposit(deposit)}: {self.describe(missing)} did not arrive within {timeout:g} s "
                    f"(the other local replicas waited); set POPDIST_COLLECTIVE_TIMEOUT to wait longer"
                )
                self._waiting[index] = False
                self._fail_locked(index, error)
            raise error
        result = self._results[index]
        self._results[index] = None
        if isinstance(result, _Aborted):
            raise result.error
        return result

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
                self._results[j] = _Aborted(self._abort_error())
                self._waiting[j] = False
                self._sems[j].release()

    def _abort_error(self) -> StepAborted:
        err = self._failure
        who = self.describe([self._failed_by]) if self._failed_by is not None else "a replica"
        return StepAborted(f"step abandoned: {who} failed ({type(err).__name__}: {err})")
