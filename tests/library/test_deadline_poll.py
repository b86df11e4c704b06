"""deadline.poll's way of waiting, step by step on a simulated clock: spin, then yield the core,
then sleep with a doubling back-off that never passes the deadline. The clock is the module's
own view of ``time`` and ``os``; nothing else sees it."""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest

from popdist_py import deadline

#: What one test of the condition costs on the simulated clock: a power of two, so that sums of
#: ticks from a start of 64 s are exact and a deadline is met exactly.
TICK = 2.0**-16


class Clock:
    """``time`` and ``os`` as deadline.poll sees them: each condition test advances the clock by a
    tick, a sleep by its length; every yield and sleep is recorded."""

    def __init__(self) -> None:
        self.now = 64.0
        self.actions: list[tuple[str, float]] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.actions.append(("sleep", seconds))
        self.now += seconds

    def sched_yield(self) -> None:
        self.actions.append(("yield", self.now))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(deadline, "time", types.SimpleNamespace(monotonic=c.monotonic, sleep=c.sleep))
    monkeypatch.setattr(deadline, "os", types.SimpleNamespace(sched_yield=c.sched_yield))
    return c


def never(clock: Clock) -> Callable[[], bool]:
    def test() -> bool:
        clock.now += TICK
        return False
    return test


def test_it_spins_then_yields_then_sleeps_doubling_up_to_the_limit_and_stops_at_the_deadline(clock: Clock) -> None:
    start = clock.now
    end = start + 640 * TICK
    first = 2 * TICK
    assert deadline.poll(never(clock), end, spin=5 * TICK, yield_for=10 * TICK, first_sleep=first) is False
    kinds = [kind for kind, _ in clock.actions]
    yields = [at for kind, at in clock.actions if kind == "yield"]
    sleeps = [length for kind, length in clock.actions if kind == "sleep"]
    # After the first test (one tick): no yield while spinning (5 ticks), yields until 10 ticks,
    # then only sleeps.
    assert yields == [start + k * TICK for k in range(6, 11)]
    assert kinds == ["yield"] * len(yields) + ["sleep"] * len(sleeps)
    # The sleeps double from first_sleep up to MAX_SLEEP, and the last one ends at the deadline.
    doubling = [first * 2**k for k in range(6)]
    assert sleeps[:6] == doubling and doubling[-1] < deadline.MAX_SLEEP < 2 * doubling[-1]
    assert set(sleeps[6:-1]) == {deadline.MAX_SLEEP}
    assert 0 < sleeps[-1] <= deadline.MAX_SLEEP
    assert clock.now == end + TICK  # one last test at the deadline, then it gave up


def test_it_stops_testing_exactly_at_the_deadline(clock: Clock) -> None:
    end = clock.now + 3 * TICK
    assert deadline.poll(never(clock), end, spin=1.0) is False
    assert clock.now == end and clock.actions == []  # spinning only, the third test was the last


def test_without_sleep_it_only_yields(clock: Clock) -> None:
    start = clock.now
    assert deadline.poll(never(clock), start + 0.002, sleep=False) is False
    assert clock.actions and {kind for kind, _ in clock.actions} == {"yield"}


def test_the_defaults_yield_at_once_and_sleep_after_the_yield_time(clock: Clock) -> None:
    start = clock.now
    assert deadline.poll(never(clock), start + 0.003) is False
    assert clock.actions[0] == ("yield", start + 2 * TICK)  # no spin by default
    first_sleep = next(i for i, (kind, _) in enumerate(clock.actions) if kind == "sleep")
    assert clock.actions[first_sleep] == ("sleep", deadline.FIRST_SLEEP)
    last_yield = clock.actions[first_sleep - 1][1]  # yields for SPIN after the first test (one tick)
    assert last_yield < start + TICK + deadline.SPIN <= last_yield + TICK


def test_a_condition_that_becomes_true_ends_the_wait_at_once(clock: Clock) -> None:
    results = iter([False] * 30 + [True])

    def test() -> bool:
        clock.now += TICK
        return next(results)

    assert deadline.poll(test, clock.now + 10.0) is True
    assert next(results, None) is None  # tested exactly until it was true
