"""The rendezvous at the moment a waiting replica's deadline passes, with the interleavings fixed.

A replica thread whose deadline passed may have been released at that very moment, or everyone
may have arrived while the last one is still combining, or someone really is missing: three
races that real threads hit rarely and never on demand. Here the executor's part of the
rendezvous (:class:`Waits`) is scripted by the test: a finite sleep is a deadline that has passed
unless a wake-up is already there, and the test decides what happens meanwhile.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from popdist_py.engine._collectives import rendezvous as rendezvous_module
from popdist_py.engine._collectives.rendezvous import POLL_BYTES, SPIN_SECONDS, Rendezvous, ThreadWaits
from popdist_py.engine._execution.executor import cores_per_instance, polls
from popdist_py.engine.errors import CollectiveTimeoutError, StepAborted
from tests.helpers import task_state

pytestmark = pytest.mark.one_executor


class ScriptedWaits:
    """Waits whose deadlines have always passed: a finite sleep answers at once whether a wake-up
    was there, then ``meanwhile(call)`` runs (what happened as the deadline passed); a sleep
    without a deadline runs ``meanwhile`` first, then blocks until woken."""

    def __init__(self, size: int, meanwhile: Callable[[int], None] = lambda call: None) -> None:
        self.calls: list[tuple[int, float]] = []
        self.briefs: list[bool] = []  # each sleep's ``brief``
        self.meanwhile = meanwhile
        self.wakes = [threading.Semaphore(0) for _ in range(size)]

    def reset(self) -> None:
        for wake in self.wakes:
            while wake.acquire(blocking=False):
                pass

    def sleep(self, index: int, timeout: float, brief: bool = True) -> bool:
        self.calls.append((index, timeout))
        self.briefs.append(brief)
        if math.isinf(timeout):
            self.meanwhile(len(self.calls))
            assert self.wakes[index].acquire(timeout=30), "never woken"
            return True
        woken = self.wakes[index].acquire(blocking=False)
        self.meanwhile(len(self.calls))
        return woken

    def wake(self, index: int) -> None:
        self.wakes[index].release()

    def pending(self) -> list[int]:
        """Replicas with a wake-up nobody consumed (it would end their next sleep at once)."""
        left = [i for i, wake in enumerate(self.wakes) if wake.acquire(blocking=False)]
        for i in left:
            self.wakes[i].release()
        return left


def rendezvous(waits: ScriptedWaits, combine: Callable[[list[Any]], list[Any]] | None = None) -> Rendezvous:
    r = Rendezvous(2, combine or (lambda deposits: [f"{d} for {i}" for i, d in enumerate(deposits)]),
                   lambda js: ", ".join(f"replica {j}" for j in js), lambda d: f"collective {d}", waits)
    r.reset()
    return r


def test_a_replica_released_as_its_deadline_passed_takes_its_result() -> None:
    got: dict[int, Any] = {}

    def meanwhile(call: int) -> None:
        if call == 1:  # replica 1 arrives, combines and releases replica 0 just as 0's deadline passes
            waiting.append(r.waiting)
            got[1] = r.arrive(1, "b", timeout=5)

    waiting: list[int] = []
    waits = ScriptedWaits(2, meanwhile)
    r = rendezvous(waits)
    got[0] = r.arrive(0, "a", timeout=5)
    assert got == {0: "a for 0", 1: "b for 1"}
    assert waiting == [1] and r.waiting == 0  # replica 0 waited; nobody waits once it is released
    assert waits.calls == [(0, 5), (0, 0.0)]  # a second look, without waiting, found the wake-up
    assert waits.pending() == [] and not r.failed


def test_a_replica_released_after_its_second_look_takes_the_wake_up_with_it() -> None:
    got: dict[int, Any] = {}

    def meanwhile(call: int) -> None:
        if call == 2:  # the second look found nothing; replica 1 releases 0 right after it
            got[1] = r.arrive(1, "b", timeout=5)

    waits = ScriptedWaits(2, meanwhile)
    r = rendezvous(waits)
    got[0] = r.arrive(0, "a", timeout=5)
    assert got == {0: "a for 0", 1: "b for 1"}
    assert waits.calls == [(0, 5), (0, 0.0), (0, 0.0)]
    assert waits.pending() == []  # left behind, it would end the next collective's wait at once


@pytest.mark.parametrize("earlier", [0, 2])
def test_a_replica_whose_deadline_passed_while_the_last_one_combines_waits_for_the_result(earlier: int) -> None:
    # After ``earlier`` collectives completed as usual (replica 0 released as its deadline passes):
    # each completed collective counts, so the waiter can tell "all arrived" from "one missing".
    combining, proceed = threading.Event(), threading.Event()
    got: dict[int, Any] = {}
    round_ = [0]

    def combine(deposits: list[Any]) -> list[Any]:
        if round_[0] == earlier:
            combining.set()
            assert proceed.wait(30)
        return [f"{d} combined" for d in deposits]

    def meanwhile(call: int) -> None:
        base = 2 * earlier  # each earlier collective took two sleeps
        if call <= base:
            if call % 2 == 1:
                got[1] = r.arrive(1, "b", timeout=5)
        elif call == base + 1:  # replica 1 arrives last and is still combining when 0's deadline passes
            worker = threading.Thread(target=lambda: got.update({1: r.arrive(1, "b", timeout=5)}))
            worker.start()
            threads.append(worker)
            assert combining.wait(30)
        elif call == base + 3:  # replica 0 waits for the result without a deadline: let the combine end
            proceed.set()

    threads: list[threading.Thread] = []
    waits = ScriptedWaits(2, meanwhile)
    r = rendezvous(waits, combine)
    for round_[0] in range(earlier + 1):
        got[0] = r.arrive(0, "a", timeout=5)
    threads[0].join(30)
    assert got == {0: "a combined", 1: "b combined"}
    assert waits.calls == [(0, 5), (0, 0.0)] * earlier + [(0, 5), (0, 0.0), (0, math.inf)]
    assert waits.pending() == [] and not r.failed


def test_a_failed_combine_releases_the_waiting_replica_with_its_error() -> None:
    def combine(deposits: list[Any]) -> list[Any]:
        raise ValueError("bad deposits")

    def meanwhile(call: int) -> None:
        if call == 1:
            with pytest.raises(ValueError, match="bad deposits"):  # raised in the combiner itself
                r.arrive(1, "b", timeout=5)

    waits = ScriptedWaits(2, meanwhile)
    r = rendezvous(waits, combine)
    with pytest.raises(StepAborted, match=r"^step abandoned: replica 1 failed \(ValueError: bad deposits\)$"):
        r.arrive(0, "a", timeout=5)
    assert r.failed_by == 1 and str(r.failure) == "bad deposits"


def test_a_replica_that_never_arrives_is_named_and_fails_the_run() -> None:
    waits = ScriptedWaits(2)
    r = rendezvous(waits)
    with pytest.raises(CollectiveTimeoutError) as info:
        r.arrive(0, "a", timeout=5)
    assert str(info.value) == ("collective a: replica 1 did not arrive within 5 s (the other local replicas "
                               "waited); set POPDIST_COLLECTIVE_TIMEOUT to wait longer")
    assert waits.calls == [(0, 5), (0, 0.0)]
    assert waits.pending() == []  # replica 0 is not woken again by its own failure
    assert r.failure is info.value and r.failed_by == 0
    with pytest.raises(StepAborted) as late:  # the latecomer is refused at once
        r.arrive(1, "a", timeout=5)
    assert str(late.value) == f"step abandoned: replica 0 failed (CollectiveTimeoutError: {info.value})"
    assert waits.calls == [(0, 5), (0, 0.0)]
    r.reset()  # a new run forgets it
    assert not r.failed and r.failed_by is None


def test_a_failure_releases_the_waiting_replica_with_who_failed_and_how() -> None:
    def meanwhile(call: int) -> None:
        if call == 1:
            r.fail(1, KeyError("late"))

    waits = ScriptedWaits(2, meanwhile)
    r = rendezvous(waits)
    with pytest.raises(StepAborted, match=r"^step abandoned: replica 1 failed \(KeyError: 'late'\)$"):
        r.arrive(0, "a", timeout=5)
    assert waits.calls == [(0, 5), (0, 0.0)] and waits.pending() == []
    assert r.failed_by == 1 and isinstance(r.failure, KeyError)


def test_one_replica_combines_alone_and_records_its_failure() -> None:
    calls: list[list[Any]] = []

    def combine(deposits: list[Any]) -> list[Any]:
        calls.append(deposits)
        if deposits == ["bad"]:
            raise ValueError("bad deposit")
        return [f"{deposits[0]}!"]

    r = Rendezvous(1, combine, lambda js: f"replica {js[0]}", str, ScriptedWaits(1))
    r.reset()
    assert r.arrive(0, "a", timeout=5) == "a!"
    with pytest.raises(ValueError, match="bad deposit"):
        r.arrive(0, "bad", timeout=5)
    assert r.failed_by == 0 and str(r.failure) == "bad deposit"
    with pytest.raises(StepAborted, match=r"^step abandoned: replica 0 failed \(ValueError: bad deposit\)$"):
        r.arrive(0, "c", timeout=5)
    assert calls == [["a"], ["bad"]]


@pytest.mark.parametrize("poll", [0.0, SPIN_SECONDS])
def test_a_thread_waits_polls_then_sleeps_and_always_answers_its_wake_up(poll: float) -> None:
    """A wake-up already there, one during the polling, one after it (asleep), and none at all."""
    waits = ThreadWaits(2, poll)
    waits.wake(0)
    assert waits.sleep(0, 0.0)  # already there: no deadline needed
    assert not waits.sleep(0, 0.0)  # nothing there, no time to wait
    polling = threading.Event()
    woken: list[bool] = []

    def sleep() -> None:
        polling.set()
        woken.append(waits.sleep(1, 30.0))

    for delay in ("during the polling", "while asleep"):
        woken.clear()
        sleeper = threading.Thread(target=sleep)
        sleeper.start()
        assert polling.wait(30)
        if delay == "while asleep":  # the polling window is bounded: the thread is then blocked
            deadline = time.monotonic() + 30
            while task_state(f"/proc/self/task/{sleeper.native_id}") != "S" and time.monotonic() < deadline:
                time.sleep(SPIN_SECONDS)
        waits.wake(1)
        sleeper.join(30)
        assert woken == [True], delay
        polling.clear()
    start = time.monotonic()
    assert not waits.sleep(1, 0.05)  # a deadline longer than the polling still holds
    assert 0.04 <= time.monotonic() - start < 10



def test_a_thread_polls_only_for_a_brief_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """brief=False (a large collective): straight to sleep on the lock, no poll; either way the
    deadline is the deadline, the polling included."""
    polled = threading.Event()

    def yield_() -> None:  # the real yield, seen
        polled.set()
        os.sched_yield()

    monkeypatch.setattr(rendezvous_module, "_yield", yield_)
    waits = ThreadWaits(1, poll=1.0)
    assert not waits.sleep(0, 0.02, brief=False) and not polled.is_set()
    start = time.monotonic()
    assert not waits.sleep(0, 1.5) and polled.is_set()  # brief: polls for 1 s, then sleeps the rest
    assert 1.4 <= time.monotonic() - start < 2.3  # not the poll's second again on top
    waits.wake(0)
    assert waits.sleep(0, 30.0, brief=False)


def test_an_arrival_waits_briefly_unless_it_says_the_collective_is_large() -> None:
    def first_sleep(**brief: bool) -> bool:
        waits = ScriptedWaits(2, meanwhile=lambda call: None if call > 1 else r.arrive(1, "b", timeout=5))
        r = rendezvous(waits)
        assert r.arrive(0, "a", timeout=math.inf, **brief) == "a for 0"
        return waits.briefs[0]

    assert first_sleep() and not first_sleep(brief=False)


@pytest.mark.skipif(cores_per_instance() < 2, reason="replica threads poll only with a core each")
def test_replica_threads_poll_for_small_collectives_and_not_for_large_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica that waits for another polls for an all-reduce of POLL_BYTES per replica, and
    sleeps at once for a larger one, whose slice threads need the core it would take."""
    from popdist_py.engine import Runtime, ops

    def polls_for(nbytes: int, wait_up_to: float) -> bool:
        polled = threading.Event()
        monkeypatch.setattr(rendezvous_module, "_yield", polled.set)  # (the yield itself is beside the point)

        def step(ctx: Any, x: np.ndarray) -> np.ndarray:
            if ctx.local_index == 1:  # let replica 0 wait first: until it polls, or a while
                polled.wait(wait_up_to)
            return ops.replicated_all_reduce(x, op="add")

        x = np.ones((2, nbytes // 4), np.float32)
        with Runtime(2, executor="threads") as rt:
            got = rt.run(step, x)
        np.testing.assert_array_equal(got[0], np.full(nbytes // 4, 2, np.float32))
        return polled.is_set()

    assert polls_for(POLL_BYTES, wait_up_to=30)
    assert not polls_for(POLL_BYTES + 4, wait_up_to=0.5)


def test_replica_threads_poll_only_where_each_has_a_core() -> None:
    cores = cores_per_instance()
    assert polls(max(1, cores)) == (cores >= 1)
    assert not polls(cores + 1)
