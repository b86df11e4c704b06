"""The two executors of a Runtime's local replicas: the auto rule, the override, cooperative specifics.

Like every engine test module, under both executors (the ``executor`` fixture of tests/conftest.py).
"""

from __future__ import annotations

import gc
import inspect
import os
import threading
import time
import weakref

import greenlet
import numpy as np
import pytest

from popcontract.environment import ENGINE_EXECUTOR as ENV
from popdist_py.engine import Runtime, StepAborted, ops
from popdist_py.engine._execution.cooperative import CooperativePool
from popdist_py.engine._execution.executor import cores_per_instance
from popdist_py.engine._execution.pool import ReplicaPool
from popdist_py.engine._step import context
from popdist_py.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No override, no poprun topology: the auto rule decides."""
    for name in (ENV, "LOCAL_WORLD_SIZE", "POPDIST_NUM_TOTAL_REPLICAS", "POPDIST_NUM_LOCAL_REPLICAS",
                 "POPDIST_REPLICA_INDEX_OFFSET"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def cores(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)


def test_both_executors_have_one_run_signature(executor: str) -> None:
    if executor != "threads":
        pytest.skip("independent of the module's executor")
    assert inspect.signature(ReplicaPool.run) == inspect.signature(CooperativePool.run)
    assert list(inspect.signature(ReplicaPool.run).parameters) == ["self", "task", "stall"]


# -- choosing -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ncores, local_world_size, L, expect",
    [
        (2, None, 2, "threads"),        # one process on 2 cores: replicas compute in parallel
        (2, "2", 2, "cooperative"),     # poprun put 2 instances on these 2 cores: 1 core each
        (4, "2", 4, "threads"),
        (3, "2", 2, "cooperative"),     # 1.5 cores each is not 2
        (1, None, 4, "cooperative"),
        (64, None, 1, "cooperative"),   # L == 1: nothing to schedule (the step runs inline anyway)
    ],
)
def test_auto_rule(clean_env: pytest.MonkeyPatch, executor: str, ncores: int, local_world_size: str | None,
                   L: int, expect: str) -> None:
    if executor != "threads":
        pytest.skip("independent of the module's executor")
    cores(clean_env, ncores)
    if local_world_size is not None:
        clean_env.setenv("LOCAL_WORLD_SIZE", local_world_size)
    with Runtime(replication=L) as rt:
        assert rt.executor == expect
    with Runtime(replication=L, executor="auto") as rt:
        assert rt.executor == expect


def test_an_unusable_local_world_size_is_an_error(clean_env: pytest.MonkeyPatch, executor: str) -> None:
    if executor != "threads":
        pytest.skip("independent of the module's executor")
    clean_env.setenv("LOCAL_WORLD_SIZE", "junk")
    with pytest.raises(ValueError, match=r"^LOCAL_WORLD_SIZE='junk' is not an integer \(use a whole number >= 1\)$"):
        Runtime(replication=2)


def test_auto_rule_without_affinity(clean_env: pytest.MonkeyPatch, executor: str) -> None:
    if executor != "threads":
        pytest.skip("independent of the module's executor")
    clean_env.delattr(os, "sched_getaffinity", raising=False)
    clean_env.setattr(os, "cpu_count", lambda: 6)
    clean_env.setenv("LOCAL_WORLD_SIZE", "3")
    assert cores_per_instance() == 2
    with Runtime(replication=2) as rt:
        assert rt.executor == "threads"


def test_replica_counts_are_bounded(clean_env: pytest.MonkeyPatch, executor: str) -> None:
    if executor != "threads":
        pytest.skip("independent of the module's executor")
    cores(clean_env, 16)
    before = threading.active_count()
    with pytest.raises(ValueError, match=r"^replication=100000 makes 100000 replicas in one process, more than "
                                         r"65536: use fewer replicas or more instances$"):
        Runtime(replication=100000)
    with pytest.raises(ValueError, match=r"the threads executor runs at most 1024 local replicas \(one thread "
                                         r"each\), not 1025"):
        Runtime(replication=1025, executor="threads")
    assert threading.active_count() == before
    with Runtime(replication=1025) as rt:  # auto: cooperative above the threads' limit
        assert rt.executor == "cooperative"


def test_a_failed_thread_start_stops_the_started_threads(monkeypatch: pytest.MonkeyPatch, executor: str) -> None:
    if executor != "threads":
        pytest.skip("independent of the module's executor")
    before = threading.active_count()
    real_start = threading.Thread.start
    calls = []

    def start(self: threading.Thread) -> None:
        calls.append(self.name)
        if len(calls) > 3:
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError, match=r"^could not start replica thread 4 of the 7 that 8 local replicas need "
                                           r"\(can't start new thread\); the 3 started were stopped"):
        Runtime(replication=8, executor="threads")
    monkeypatch.setattr(threading.Thread, "start", real_start)
    assert threading.active_count() == before  # shutdown() joined them
    with Runtime(replication=4, executor="threads", timeout=30) as rt:  # the next runtime works
        got = rt.run(lambda ctx, x: ops.replicated_all_reduce(x), np.ones((4, 1)))
        assert got.tolist() == [[4.0]] * 4


def test_environment_override_and_argument_precedence(clean_env: pytest.MonkeyPatch, executor: str) -> None:
    cores(clean_env, 16)
    clean_env.setenv(ENV, f"  {executor.upper()} ")
    with Runtime(replication=2) as rt:
        assert rt.executor == executor
    other = "threads" if executor == "cooperative" else "cooperative"
    with Runtime(replication=2, executor=other) as rt:  # the argument wins
        assert rt.executor == other
    with Runtime(replication=2, executor="auto") as rt:  # so does an explicit auto
        assert rt.executor == "threads"


def test_invalid_values_are_named(clean_env: pytest.MonkeyPatch, executor: str) -> None:
    clean_env.setenv(ENV, "fibers")
    with pytest.raises(ValueError) as info:
        Runtime(replication=2)
    msg = str(info.value)
    assert ENV in msg and "'fibers'" in msg and "auto, threads, cooperative" in msg
    with pytest.raises(ValueError, match=r"executor='greenlets' is not one of auto, threads, cooperative"):
        Runtime(replication=2, executor="greenlets")
    with Runtime(replication=2, executor=executor) as rt:  # the argument wins over a bad environment
        assert rt.executor == executor


# -- both executors: what the step sees ---------------------------------------------------------------
@pytest.mark.parametrize("L", [1, 2, 4])
def test_context_belongs_to_its_replica_across_collectives(L: int) -> None:
    with Runtime(replication=L, timeout=30) as rt:
        def step(ctx, x):  # type: ignore[no-untyped-def]
            seen = [context.current().local_index]
            for _ in range(3):
                x = ops.replicated_all_reduce(x) * 0 + ctx.local_index
                seen.append(context.current().local_index)
            return np.array(seen)

        got = rt.run(step, np.zeros((L, 2)))
        assert got.tolist() == [[i] * 4 for i in range(L)]
        assert context.peek() is None


@pytest.mark.parametrize("replica", [0, 1])
def test_replica_with_an_extra_collective_is_reported_at_once(replica: int) -> None:
    with Runtime(replication=3, timeout=600) as rt:
        def step(ctx):  # type: ignore[no-untyped-def]
            x = ops.replicated_all_reduce(np.ones(2))
            if ctx.local_index == replica:
                x = ops.replicated_all_reduce(x)
            return x

        t = time.monotonic()
        with pytest.raises(CollectiveMismatchError) as info:
            rt.run(step)
        assert time.monotonic() - t < 10
        msg = str(info.value)
        assert f"replica {replica} called replicated_all_reduce" in msg and "finished its step" in msg
        assert rt.run(lambda ctx: ops.replicated_all_reduce(np.ones(1)))[0, 0] == 3  # still usable


def test_runtime_is_collected_without_close(executor: str) -> None:
    rt = Runtime(replication=3)
    rt.run(lambda ctx, x: ops.replicated_all_reduce(x), np.ones((3, 2)))
    ref = weakref.ref(rt)
    del rt
    gc.collect()
    assert ref() is None


# -- cooperative specifics ------------------------------------------------------------------------------
def test_cooperative_replicas_take_turns_on_the_calling_thread() -> None:
    L = 4
    with Runtime(replication=L, executor="cooperative") as rt:
        assert rt.executor == "cooperative"
        before = threading.active_count()
        order: list[tuple[int, int]] = []

        def step(ctx):  # type: ignore[no-untyped-def]
            for k in range(3):
                order.append((k, ctx.local_index))
                ops.replicated_all_reduce(np.zeros(1))
            return np.array(threading.get_ident())

        idents = rt.run(step)
        assert set(idents.tolist()) == {threading.get_ident()}
        assert threading.active_count() == before  # no replica threads
        # everyone reaches collective k before anyone passes it, and they start in order
        assert [k for k, _ in order] == sorted(k for k, _ in order) and len(order) == 3 * L
        assert order[:L] == [(0, i) for i in range(L)]


def test_cooperative_replicas_see_the_callers_context_variables() -> None:
    with Runtime(replication=3, executor="cooperative") as rt, np.errstate(divide="raise"):
        def step(ctx):  # type: ignore[no-untyped-def]
            ops.replicated_all_reduce(np.zeros(1))
            return np.float64(1.0) / np.float64(ctx.local_index)  # replica 0 divides by zero

        with pytest.raises(FloatingPointError):
            rt.run(step)


def test_cooperative_runs_from_several_threads_in_turn() -> None:
    with Runtime(replication=2, executor="cooperative") as rt:
        got: list[np.ndarray] = []
        t = threading.Thread(target=lambda: got.append(rt.run(lambda ctx, x: ops.replicated_all_reduce(x),
                                                              np.ones((2, 1)))))
        t.start()
        t.join(30)
        assert got and got[0].tolist() == [[2], [2]]
        assert rt.run(lambda ctx, x: ops.replicated_all_reduce(x), np.ones((2, 1))).tolist() == [[2], [2]]


def test_cooperative_stall_is_reported_at_once_as_a_timeout() -> None:
    """A replica that leaves its greenlet outside a collective can never arrive: no deadline needed."""
    seen: dict[int, BaseException] = {}
    with Runtime(replication=3, executor="cooperative", timeout=600) as rt:
        def step(ctx):  # type: ignore[no-untyped-def]
            if ctx.local_index == 2:
                parent = greenlet.getcurrent().parent
                assert parent is not None
                parent.switch()  # what a step must not do
            try:
                return ops.replicated_all_reduce(np.ones(1))
            except BaseException as exc:
                seen[ctx.local_index] = exc
                raise

        t = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            rt.run(step)
        assert time.monotonic() - t < 10
        msg = str(info.value)
        assert "replicated_all_reduce #1 of the step: replica 2 did not arrive" in msg
        # The first waiter gets the timeout, the other waiter is told who failed and how.
        assert seen[0] is info.value and msg == (
            "replicated_all_reduce #1 of the step: replica 2 did not arrive and never will (no local replica was "
            "left to run under the cooperative executor; the others waited)")
        assert isinstance(seen[1], StepAborted)
        assert str(seen[1]) == f"step abandoned: replica 0 failed (CollectiveTimeoutError: {msg})"
        notes = " ".join(getattr(info.value, "__notes__", []))
        assert "replica 2" in notes and "switched away from its greenlet" in notes
        assert rt.run(lambda ctx, x: ops.replicated_all_reduce(x), np.ones((3, 1)))[0, 0] == 3


def test_cooperative_failure_aborts_the_waiting_replicas() -> None:
    seen: list[str] = []
    with Runtime(replication=4, executor="cooperative", timeout=600) as rt:
        def step(ctx):  # type: ignore[no-untyped-def]
            if ctx.local_index == 2:
                raise ZeroDivisionError("replica 2 fails")
            try:
                return ops.replicated_all_reduce(np.ones(1))
            except StepAborted as exc:
                seen.append(f"{ctx.local_index}: {exc}")
                raise

        with pytest.raises(ZeroDivisionError):
            rt.run(step)
        # 0 and 1 were waiting (aborted), 3 arrived after the failure (refused at once)
        assert sorted(s[0] for s in seen) == ["0", "1", "3"]
        assert all("replica 2 failed (ZeroDivisionError: replica 2 fails)" in s for s in seen)


def test_cooperative_keyboard_interrupt_in_a_replica() -> None:
    with Runtime(replication=2, executor="cooperative") as rt:
        def step(ctx):  # type: ignore[no-untyped-def]
            if ctx.local_index == 1:
                raise KeyboardInterrupt
            return ops.replicated_all_reduce(np.ones(1))

        with pytest.raises(KeyboardInterrupt):
            rt.run(step)
        assert rt.run(lambda ctx, x: ops.replicated_all_reduce(x), np.ones((2, 1)))[0, 0] == 2


def test_single_replica_runs_inline_under_either_executor(executor: str) -> None:
    with Runtime(replication=1, executor=executor) as rt:
        assert rt.executor == executor
        assert rt.run(lambda ctx: np.array(threading.get_ident()))[0] == threading.get_ident()

        def fails(ctx):  # type: ignore[no-untyped-def]
            ops.replicated_all_reduce(np.ones(1))
            raise CollectiveError("on purpose")

        with pytest.raises(CollectiveError, match="on purpose"):
            rt.run(fails)
        assert rt.run(lambda ctx, x: ops.replicated_all_reduce(x), np.ones((1, 2))).tolist() == [[1, 1]]
