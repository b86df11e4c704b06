"""Runtime in one process: topology, runs, threads, failures, timeouts (under both executors)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from popdist_py.engine import Runtime, StepAborted, ops
from popdist_py.errors import CollectiveMismatchError, CollectiveTimeoutError

POPDIST = (
    "POPDIST_NUM_TOTAL_REPLICAS",
    "POPDIST_NUM_LOCAL_REPLICAS",
    "POPDIST_REPLICA_INDEX_OFFSET",
    "POPDIST_NUM_INSTANCES",
    "POPDIST_INSTANCE_INDEX",
    "POPDIST_COLLECTIVE_TIMEOUT",
)


@pytest.fixture(autouse=True)
def no_popdist_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in POPDIST:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(params=[1, 2, 4, 8])
def rt(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    with Runtime(replication=request.param, timeout=30) as r:
        yield r


def test_default_runtime_is_one_replica() -> None:
    with Runtime() as rt:
        assert (rt.replication_factor, rt.instance_replication_factor, rt.replica_index_offset) == (1, 1, 0)
        assert rt.run(lambda ctx, x: x * 2, np.array([3])).tolist() == [6]


def test_runtime_from_single_instance_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POPDIST_NUM_TOTAL_REPLICAS", "4")
    monkeypatch.setenv("POPDIST_NUM_LOCAL_REPLICAS", "4")
    monkeypatch.setenv("POPDIST_REPLICA_INDEX_OFFSET", "0")
    with Runtime() as rt:
        assert (rt.replication_factor, rt.instance_replication_factor, rt.num_instances) == (4, 4, 1)
    with Runtime(replication=2) as rt:  # one instance: an explicit replication wins
        assert rt.replication_factor == 2


def test_replication_contradicting_multi_instance_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POPDIST_NUM_TOTAL_REPLICAS", "8")
    monkeypatch.setenv("POPDIST_NUM_LOCAL_REPLICAS", "2")
    monkeypatch.setenv("POPDIST_REPLICA_INDEX_OFFSET", "2")
    with pytest.raises(ValueError) as info:
        Runtime(replication=4)
    msg = str(info.value)
    assert "replication=4" in msg and "8 replicas" in msg and "4 instances of 2" in msg


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_replication(bad: object, exc: type) -> None:
    with pytest.raises(exc, match="replication"):
        Runtime(replication=bad)  # type: ignore[arg-type]


def test_properties_and_indices(rt: Runtime) -> None:
    L = rt.instance_replication_factor
    assert rt.replication_factor == L and rt.replica_index_offset == 0
    out = rt.run(lambda ctx: (np.array(ctx.replica_index), np.array(ctx.local_index)))
    assert out[0].tolist() == list(range(L)) and out[1].tolist() == list(range(L))


def test_inputs_are_sliced_and_outputs_stacked(rt: Runtime) -> None:
    L = rt.instance_replication_factor
    x = np.arange(L * 6, dtype=np.float32).reshape(L, 2, 3)
    y = np.arange(L)

    def step(ctx, xi, yi):  # type: ignore[no-untyped-def]
        assert xi.shape == (2, 3) and yi == ctx.local_index
        return xi + yi, np.float64(yi)

    a, b = rt.run(step, x, y)
    assert a.shape == (L, 2, 3) and np.array_equal(a, x + y[:, None, None])
    assert b.dtype == np.float64 and b.tolist() == list(range(L))
    assert rt.run(lambda ctx, xi: None, x) is None
    single = rt.run(lambda ctx: np.zeros(3))
    assert single.shape == (L, 3)


def test_wrong_leading_axis_names_it_and_L() -> None:
    with Runtime(replication=4) as rt:
        with pytest.raises(ValueError) as info:
            rt.run(lambda ctx, x: x, np.zeros((3, 2)))
        assert "leading axis of 3" in str(info.value) and "L=4" in str(info.value)
        with pytest.raises(ValueError, match="scalar"):
            rt.run(lambda ctx, x: x, 5)


def test_outputs_must_agree_between_replicas() -> None:
    with Runtime(replication=2) as rt:
        with pytest.raises(ValueError, match="replica 1 returned None"):
            rt.run(lambda ctx: None if ctx.local_index else np.zeros(1))
        with pytest.raises(ValueError, match=r"replica 1 \(2,\)"):
            rt.run(lambda ctx: np.zeros(ctx.local_index + 1))


THREADS_ONLY = "a replica blocked outside the engine blocks every replica under the cooperative executor"


def test_replicas_run_concurrently_on_persistent_threads(executor: str) -> None:
    if executor != "threads":
        pytest.skip(THREADS_ONLY)
    L = 4
    with Runtime(replication=L) as rt:
        barrier = threading.Barrier(L, timeout=10)  # only passes when all L replicas run at once

        def step(ctx):  # type: ignore[no-untyped-def]
            barrier.wait()
            return np.array(threading.get_ident())

        first = rt.run(step)
        second = rt.run(step)
        assert len(set(first.tolist())) == L
        assert first.tolist() == second.tolist()
        assert first[0] == threading.get_ident()  # replica 0 runs on the calling thread
        before = threading.active_count()
    assert threading.active_count() == before - (L - 1)


def test_closed_runtime_refuses_runs() -> None:
    rt = Runtime(replication=2)
    rt.close()
    rt.close()
    with pytest.raises(RuntimeError, match="closed"):
        rt.run(lambda ctx: None)


def test_nested_run_and_ops_outside_a_step() -> None:
    with Runtime(replication=2) as rt:
        with pytest.raises(RuntimeError, match="inside a step"):
            rt.run(lambda ctx: rt.run(lambda c: None))
        with pytest.raises(RuntimeError, match="inside a step"):
            ops.replicated_all_reduce(np.zeros(2))


# Released, not timed out: a replica left waiting by the failure would end only at the engine's
# timeout (TIMEOUT s) with a CollectiveTimeoutError instead of StepAborted; released at once, the
# run ends in milliseconds, so TIMEOUT / 4 separates the two even on a loaded 2-core host.
TIMEOUT = 8


def wait_until_waiting(rt: Runtime, n: int, executor: str) -> None:
    """Inside a step: return once ``n`` other local replicas wait in a collective, so that a failure
    raised next has to *wake* them (a replica arriving after the failure is refused without a wake).
    Under the cooperative executor the replicas run one at a time in index order until they wait,
    so every lower-indexed replica that entered a collective already waits there."""
    if executor != "threads":
        return
    rendezvous = rt._dispatcher.rendezvous
    give_up = time.monotonic() + 30
    while rendezvous.waiting < n:
        assert time.monotonic() < give_up, f"{n} replica(s) never waited in the collective"
        time.sleep(0.001)


@pytest.mark.parametrize("L", [2, 4, 8])
def test_exception_in_one_replica_releases_the_others(L: int, executor: str) -> None:
    class Boom(Exception):
        pass

    with Runtime(replication=L, timeout=TIMEOUT) as rt:
        def step(ctx, x):  # type: ignore[no-untyped-def]
            if ctx.local_index == L - 1:
                wait_until_waiting(rt, L - 1, executor)
                raise Boom("replica failed on purpose")
            return ops.replicated_all_reduce(x)

        t = time.monotonic()
        with pytest.raises(Boom) as info:
            rt.run(step, np.ones((L, 3)))
        assert time.monotonic() - t < TIMEOUT / 4, "the waiting replicas were not released"
        assert any(f"replica {L - 1}" in note for note in info.value.__notes__)
        # the runtime stays usable in one process
        assert np.array_equal(rt.run(lambda ctx, x: ops.replicated_all_reduce(x), np.ones((L, 3))), np.full((L, 3), L))


def test_exception_after_a_collective_in_others(executor: str) -> None:
    seen: dict[int, BaseException] = {}
    with Runtime(replication=4, timeout=TIMEOUT) as rt:
        def step(ctx, x):  # type: ignore[no-untyped-def]
            y = ops.replicated_all_reduce(x)
            if ctx.local_index == 0:
                wait_until_waiting(rt, 3, executor)
                raise KeyError("late")
            try:
                return ops.replicated_all_reduce(y)
            except BaseException as exc:
                seen[ctx.local_index] = exc
                raise

        t = time.monotonic()
        with pytest.raises(KeyError, match="late"):
            rt.run(step, np.ones((4, 2)))
        elapsed = time.monotonic() - t
    assert seen, "no replica waited in the second collective"
    assert all(isinstance(exc, StepAborted) for exc in seen.values()), seen
    # Each is told who failed first, and how.
    assert {str(exc) for exc in seen.values()} == {"step abandoned: replica 0 failed (KeyError: 'late')"}
    assert elapsed < TIMEOUT / 4, f"the run took {elapsed:.1f} s: the waiting replicas were not released"


def test_collective_error_caught_by_user_still_fails_the_run(executor: str) -> None:
    seen: list[BaseException] = []
    with Runtime(replication=2, timeout=TIMEOUT) as rt:
        def step(ctx, x):  # type: ignore[no-untyped-def]
            if ctx.local_index == 1:
                wait_until_waiting(rt, 1, executor)
                raise ValueError("original")
            try:
                ops.replicated_all_reduce(x)
            except BaseException as exc:
                seen.append(exc)
                if isinstance(exc, StepAborted):
                    return x
                raise
            return x

        t = time.monotonic()
        with pytest.raises(ValueError, match="original"):
            rt.run(step, np.ones((2, 1)))
        elapsed = time.monotonic() - t
    assert len(seen) == 1 and isinstance(seen[0], StepAborted), seen
    assert str(seen[0]) == "step abandoned: replica 1 failed (ValueError: original)"
    assert elapsed < TIMEOUT / 4, f"the run took {elapsed:.1f} s: the waiting replica was not released"


def test_mismatched_shapes_name_the_replicas() -> None:
    with Runtime(replication=4, timeout=60) as rt:
        def step(ctx):  # type: ignore[no-untyped-def]
            return ops.replicated_all_reduce(np.zeros(3 if ctx.replica_index == 2 else 2, np.float32))

        with pytest.raises(CollectiveMismatchError) as info:
            rt.run(step)
        msg = str(info.value)
        assert "replicas 0, 1, 3" in msg and "replica 2" in msg and "shape=(3,)" in msg and "shape=(2,)" in msg


@pytest.mark.parametrize(
    "vary, text",
    [
        (lambda i, x: ops.replicated_all_reduce(x, op="max" if i else "add"), "op=max"),
        (lambda i, x: ops.replicated_all_reduce(x.astype(np.float64) if i else x), "dtype=float64"),
        (lambda i, x: ops.replicated_all_gather(x) if i else ops.replicated_all_reduce(x), "replicated_all_gather"),
    ],
)
def test_mismatched_op_dtype_kind(vary, text: str) -> None:  # type: ignore[no-untyped-def]
    with Runtime(replication=2, timeout=60) as rt, pytest.raises(CollectiveMismatchError, match=text):
        rt.run(lambda ctx: vary(ctx.local_index, np.zeros(2, np.float32)))


def test_mismatched_groups() -> None:
    with Runtime(replication=4, timeout=60) as rt:
        a, b = rt.replica_grouping(group_size=2), rt.replica_grouping(stride=2)
        with pytest.raises(CollectiveMismatchError, match="stride=2"):
            rt.run(lambda ctx: ops.replicated_all_reduce(np.zeros(1), group=a if ctx.local_index else b))


def test_replica_that_skips_a_collective() -> None:
    with Runtime(replication=4, timeout=600) as rt:
        def step(ctx):  # type: ignore[no-untyped-def]
            if ctx.local_index != 1:
                ops.replicated_all_reduce(np.zeros(1))

        t = time.monotonic()
        with pytest.raises(CollectiveMismatchError) as info:
            rt.run(step)
        assert time.monotonic() - t < 10
        assert "replica 1 finished its step" in str(info.value)


def test_replica_that_never_arrives_is_reported_after_the_timeout(executor: str) -> None:
    if executor != "threads":
        pytest.skip(THREADS_ONLY + " (see test_engine_executor's stall test)")
    gone = threading.Event()
    with Runtime(replication=4, timeout=0.5) as rt:
        def step(ctx):  # type: ignore[no-untyped-def]
            if ctx.local_index == 3:
                gone.wait(20)  # stuck elsewhere until the others have given up
                return
            try:
                ops.replicated_all_reduce(np.zeros(1))
            finally:
                gone.set()

        t = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            rt.run(step)
        elapsed = time.monotonic() - t
        assert 0.4 < elapsed < 10
        msg = str(info.value)
        assert "replica 3 did not arrive within 0.5 s" in msg and "replicated_all_reduce #1" in msg


def test_timeout_from_environment(monkeypatch: pytest.MonkeyPatch, executor: str) -> None:
    if executor != "threads":
        pytest.skip(THREADS_ONLY)
    monkeypatch.setenv("POPDIST_COLLECTIVE_TIMEOUT", "0.3")
    gone = threading.Event()
    with Runtime(replication=2) as rt:
        def step(ctx):  # type: ignore[no-untyped-def]
            if ctx.local_index == 1:
                gone.wait(20)
                return
            try:
                ops.replicated_all_gather(np.zeros(1))
            finally:
                gone.set()

        with pytest.raises(CollectiveTimeoutError, match=r"within 0\.3 s"):
            rt.run(step)
