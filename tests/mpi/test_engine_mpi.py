"""The engine across instances (run under ``mpiexec -n 2|3|4 python -m pytest --with-mpi``).

Each test builds runtimes over sub-communicators of COMM_WORLD for every instance count that
divides the replica count, and compares with the same replicas run in one process: results
must be bitwise identical for every split (1xR, 2xR/2, ...).
"""

from __future__ import annotations

import gc
import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from popdist_py.engine import (
    CommGroup,
    InstancesDisagreeError,
    PeerAborted,
    PeerClosed,
    ReplicaGrouping,
    Runtime,
    StepContext,
    ops,
)
from popdist_py.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError
from tests.engine_helpers import instances, load_script, valid_groupings, world

pytestmark = pytest.mark.engine  # under both executors (tests/conftest.py)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "engine_train.py"
#: Tag of the message that tells a late instance the others have given up (test communicator).
GAVE_UP = 77


def splits(replicas: int) -> list[int]:
    return [i for i in range(2, world().size + 1) if replicas % i == 0]


def wild(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 5, shape)).astype(np.float32)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("replicas", [4, 6, 8])
def test_training_hash_is_identical_for_every_split(replicas: int) -> None:
    train = load_script(SCRIPT)
    with Runtime(replication=replicas) as rt:
        expect = train.digest(train.train(rt))
    for count in splits(replicas):
        with instances(count) as comm:
            if comm is None:
                continue
            with Runtime(replication=replicas, comm=comm, timeout=60) as rt:
                assert (rt.num_instances, rt.instance_replication_factor) == (count, replicas // count)
                got = train.digest(train.train(rt))
            assert got == expect, f"{count} instances x {replicas // count} replicas"


@pytest.mark.mpi(min_size=2)
def test_training_hash_is_identical_for_every_split_and_executor(executor: str) -> None:
    """1 x 4 threads == 1 x 4 cooperative == 2 x 2 (and 4 x 1) under either executor, bitwise."""
    if executor != "threads":
        pytest.skip("compares both executors itself")
    train = load_script(SCRIPT)
    with Runtime(replication=4, executor="threads") as rt:
        expect = train.digest(train.train(rt))
    with Runtime(replication=4, executor="cooperative") as rt:
        assert train.digest(train.train(rt)) == expect, "1 x 4 cooperative"
    for count in splits(4):
        for ex in ("cooperative", "threads"):
            with instances(count) as comm:
                if comm is None:
                    continue
                with Runtime(replication=4, comm=comm, timeout=60, executor=ex) as rt:
                    assert rt.executor == ex
                    got = train.digest(train.train(rt))
                assert got == expect, f"{count} instances x {4 // count} replicas, {ex}"


def collectives_step(R: int):  # type: ignore[no-untyped-def]
    """A step running every collective kind over every grouping (eager and bulk sizes)."""
    groups = valid_groupings(R)

    def step(ctx, small, big):  # type: ignore[no-untyped-def]
        out = []
        for rg in groups:
            for x in (small, big):
                out.append(ops.replicated_all_reduce(x, group=rg))
                out.append(ops.replicated_all_reduce(x, op="mean", group=rg))
            out.append(ops.replicated_all_reduce(small, op="max", group=rg))
            out.append(ops.replicated_all_reduce(small, op="mul", group=rg))
            out.append(ops.replicated_all_gather(small, axis=1, group=rg).reshape(-1))
            out.append(ops.replicated_all_gather(big, group=rg).reshape(-1))
            out.append(ops.replicated_reduce_scatter(small, group=rg))
            out.append(ops.replicated_reduce_scatter(big, op="mean", group=rg))
            out.append(ops.replica_sharded_slice(small, group=rg))
        return tuple(out)

    return step


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("replicas", [4, 6, 8])
def test_grouped_collectives_match_one_process(replicas: int) -> None:
    rng = np.random.default_rng(replicas)
    small = wild(rng, (replicas, 3, 5))
    big = wild(rng, (replicas, 9001))  # 36 KB: above the eager limit, odd so chunks are uneven
    step = collectives_step(replicas)
    with Runtime(replication=replicas) as rt:
        expect = rt.run(step, small, big)
    for count in splits(replicas):
        with instances(count) as comm:
            if comm is None:
                continue
            with Runtime(replication=replicas, comm=comm, timeout=60) as rt:
                off, L = rt.replica_index_offset, rt.instance_replication_factor
                got = rt.run(step, small[off : off + L], big[off : off + L])
            for i, (g, e) in enumerate(zip(got, expect, strict=True)):
                assert g.tobytes() == e[off : off + L].tobytes(), f"output {i}, {count} instances"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("replicas", [4, 6])
def test_variables_across_instances(replicas: int) -> None:
    def build(rt: Runtime) -> list[Any]:
        vs = []
        for rg in valid_groupings(replicas):
            host = np.arange(rg.num_groups * 4, dtype=np.float64).reshape(rg.num_groups, 2, 2)
            host = host if rg.num_groups > 1 else host[0]
            for mode in ("one_per_group", "all_replicas"):
                vs.append(rt.variable(host, replica_grouping=rg, retrieval_mode=mode))
        return vs

    def diverge(vs: list[Any]):  # type: ignore[no-untyped-def]
        def step(ctx):  # type: ignore[no-untyped-def]
            for v in vs:
                ctx[v] = ctx[v] * (1 + ctx.replica_index) + ctx.replica_index
        return step

    def collect(rt: Runtime, vs: list[Any]) -> list[np.ndarray]:
        out = [rt.get_tensor_data(v) for v in vs]
        rt.run(diverge(vs))
        out += [rt.get_tensor_data(v) for v in vs]
        for v in vs:
            rt.write_variable_data(v, rt.get_tensor_data(v) if v.retrieval_mode == "one_per_group"
                                   else np.zeros(v.shape_on_host) + 7)
        return out + [rt.get_tensor_data(v) for v in vs]

    with Runtime(replication=replicas) as rt:
        expect = collect(rt, build(rt))
    for count in splits(replicas):
        with instances(count) as comm:
            if comm is None:
                continue
            with Runtime(replication=replicas, comm=comm, timeout=60) as rt:
                got = collect(rt, build(rt))
            assert len(got) == len(expect)
            for g, e in zip(got, expect, strict=True):
                assert g.shape == e.shape and g.tobytes() == e.tobytes()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n", [8, 20000])
def test_mismatch_between_instances_is_named_on_every_instance(n: int) -> None:
    with instances(2) as comm:
        if comm is None:
            return
        with Runtime(replication=4, comm=comm, timeout=30) as rt:
            size = n + 1 if rt.instance_index == 1 else n

            def step(ctx):  # type: ignore[no-untyped-def]
                return ops.replicated_all_reduce(np.zeros(size, np.float32))

            with pytest.raises(InstancesDisagreeError) as info:  # a CollectiveMismatchError raised everywhere
                rt.run(step)
            msg = str(info.value)
            assert "instance 0 (replicas 0-1)" in msg and "instance 1 (replicas 2-3)" in msg
            assert f"({n},)" in msg and f"({n + 1},)" in msg
            # every instance raised: they are still in step and the runtime stays usable
            got = rt.run(lambda ctx: ops.replicated_all_reduce(np.array([ctx.replica_index])))
            assert got.tolist() == [[6], [6]]


@pytest.mark.mpi(min_size=2)
def test_a_collective_skipped_on_one_instance_is_named_by_each_instances_step() -> None:
    """Instance 1's first step skips the allreduce instance 0's makes (a step with no collective is
    local), so its second step's allreduce meets instance 0's first: the mismatch says which step
    each instance is in, and why they can differ."""
    with instances(2) as comm:
        if comm is None:
            return
        with Runtime(replication=4, comm=comm, timeout=30) as rt:
            me = rt.instance_index

            def first(ctx: StepContext) -> np.ndarray | None:
                return ops.replicated_all_reduce(np.zeros(2)) if me == 0 else None

            def second(ctx: StepContext) -> np.ndarray:
                return ops.replicated_all_reduce(np.zeros(1))

            with pytest.raises(InstancesDisagreeError) as info:
                rt.run(first)
                rt.run(second)  # instance 1 only: its first step was local
            msg = str(info.value)
            assert re.search(r"steps differ between instances: instance 0 \(replicas 0-1\) 1, instance 1 "
                             r"\(replicas 2-3\) 2 \(each instance's count of Runtime\.run calls: a step in which "
                             r"one instance called no collective", msg), msg
            assert "shapes differ between instances: instance 0 (replicas 0-1) (2,), instance 1 (replicas 2-3) (1,)" \
                in msg, msg
            assert rt.run(second).tolist() == [[0.0]] * 2  # raised on both: still in step


@pytest.mark.mpi(min_size=3)
def test_truncated_message_while_another_peer_is_late_leaves_the_runtime_usable() -> None:
    # Instance 1 sends longer messages (truncated at the others) while instance 2 arrives late:
    # the error comes from the first peer's message with the second's receive still pending.
    with instances(3) as comm:
        if comm is None:
            return
        with Runtime(replication=3, comm=comm, timeout=30) as rt:
            me = rt.instance_index
            size = 9 if me == 1 else 8

            def step(ctx):  # type: ignore[no-untyped-def]
                if me == 2:  # late, by a guess: the others raise only once every peer's message is in,
                    time.sleep(0.3)  # so no message of the test can order it (either order passes)
                return ops.replicated_all_reduce(np.zeros(size, np.float32))

            with pytest.raises(CollectiveMismatchError, match=r"\(8,\).*\(9,\)|\(9,\).*\(8,\)"):
                rt.run(step)
            # every request had completed: the same plan (size 8) exchanges again, with fresh data
            for k in range(1, 4):
                got = rt.run(lambda ctx, k=k: ops.replicated_all_reduce(np.full(8, k * (ctx.replica_index + 1),
                                                                                   np.float32)))
                assert got.tolist() == [[6 * k] * 8]


@pytest.mark.mpi(min_size=2)
def test_op_and_group_mismatch_between_instances() -> None:
    with instances(2) as comm:
        if comm is None:
            return
        with Runtime(replication=4, comm=comm, timeout=30) as rt:
            other = rt.instance_index == 1
            with pytest.raises(CollectiveMismatchError, match=r"ops differ.*instance 0 .*add.*instance 1 .*max"):
                rt.run(lambda ctx: ops.replicated_all_reduce(np.zeros(2), op="max" if other else "add"))
            rg = rt.replica_grouping(stride=2) if other else CommGroup.consecutive(2)
            with pytest.raises(CollectiveMismatchError, match="groups differ"):
                rt.run(lambda ctx: ops.replicated_all_gather(np.zeros(2), group=rg))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n", [8, 20000])
def test_op_spellings_agree_between_instances(n: int) -> None:
    """``sum`` on one instance and ``add`` on the other are the same collective (and ``prod``/``mul``)."""
    with instances(2) as comm:
        if comm is None:
            return
        with Runtime(replication=4, comm=comm, timeout=30) as rt:
            other = rt.instance_index == 1
            x = np.arange(1, n + 1, dtype=np.float32) / n

            def step(ctx: StepContext, op: str) -> np.ndarray:
                return ops.replicated_all_reduce(x * (ctx.replica_index + 1), op=op)

            want = rt.run(lambda ctx: step(ctx, "add"))
            assert rt.run(lambda ctx: step(ctx, "sum" if other else "add")).tobytes() == want.tobytes()
            got = rt.run(lambda ctx: ops.replicated_all_reduce(np.full(3, ctx.replica_index + 1.0),
                                                               op="mul" if other else "prod"))
            assert got.tolist() == [[24.0] * 3] * 2


@pytest.mark.mpi(min_size=2)
def test_exception_on_one_instance_releases_the_others_at_once() -> None:
    with instances(2) as comm:
        if comm is None:
            return
        with Runtime(replication=4, comm=comm, timeout=60) as rt:
            def step(ctx):  # type: ignore[no-untyped-def]
                if ctx.replica_index == 1:
                    raise ZeroDivisionError("replica 1 fails")
                return ops.replicated_all_reduce(np.ones(3))

            t = time.monotonic()
            if rt.instance_index == 0:
                with pytest.raises(ZeroDivisionError):
                    rt.run(step)
            else:
                with pytest.raises(PeerAborted, match="instance 0 \\(replicas 0-1\\) abandoned"):
                    rt.run(step)
            assert time.monotonic() - t < 20  # not the 60 s timeout
            # the next run first brings both back in step, over a new communicator
            assert rt.run(lambda ctx: ops.replicated_all_reduce(np.ones(3))).tolist() == [[4.0] * 3] * 2


@pytest.mark.mpi(min_size=2)
def test_an_invalid_collective_on_every_instance_leaves_the_runtime_usable() -> None:
    """op='avg' raises ValueError in every replica of every instance (each sees the others' abort
    notice too late to matter): the runtime goes on, as it does in one process."""
    with instances(2) as comm:
        if comm is None:
            return
        with Runtime(replication=4, comm=comm, timeout=60) as rt:
            with pytest.raises(ValueError, match="avg"):
                rt.run(lambda ctx: ops.replicated_all_reduce(np.ones(3), op="avg"))
            for k in range(1, 4):  # in step again, each collective paired with its own
                got = rt.run(lambda ctx, k=k: ops.replicated_all_reduce(np.full(2, float(k))))
                assert got.tolist() == [[4.0 * k] * 2] * 2


@pytest.mark.mpi(min_size=2)
def test_a_failure_in_a_local_step_is_met_when_the_other_instance_next_exchanges() -> None:
    """Instance 0's step fails without a collective while instance 1's step has none either: instance
    1 learns of it at its next collective (PeerAborted), and the next run of each brings them back
    in step."""
    with instances(2) as comm:
        if comm is None:
            return
        with Runtime(replication=2, comm=comm, timeout=60) as rt:
            me = rt.instance_index

            def local(ctx: StepContext) -> None:
                if me == 0:
                    raise KeyError("local failure")

            def exchange(ctx: StepContext) -> np.ndarray:
                return ops.replicated_all_reduce(np.array([ctx.replica_index + 1.0]))

            if me == 0:
                with pytest.raises(KeyError):
                    rt.run(local)
            else:
                rt.run(local)
                with pytest.raises(PeerAborted, match=r"instance 0 .* abandoned"):
                    rt.run(exchange)
            assert rt.run(exchange).tolist() == [[3.0]]


@pytest.mark.mpi(min_size=2)
def test_an_instance_that_closes_instead_of_meeting_is_named_at_once() -> None:
    """Instance 0's step fails; instance 1, whose steps are local, never sees it and closes its
    runtime: instance 0's next run is a PeerClosed at once, not a wait for the 60 s timeout."""
    with instances(2) as comm:
        if comm is None:
            return
        rt = Runtime(replication=2, comm=comm, timeout=60)
        if rt.instance_index == 1:
            rt.run(lambda ctx: None)
            rt.close()
            return
        def fails(ctx: StepContext) -> None:
            raise KeyError("instance 0 only")

        with pytest.raises(KeyError):
            rt.run(fails)
        t = time.monotonic()
        with pytest.raises(PeerClosed, match=r"instance 1 .* closed its Runtime instead"):
            rt.run(lambda ctx: ops.replicated_all_reduce(np.ones(1)))
        assert time.monotonic() - t < 20
        with pytest.raises(CollectiveError, match="create a new Runtime"):
            rt.run(lambda ctx: None)
        rt.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("then", ["close", "collect"])
def test_a_step_that_skips_a_collective_is_named_when_that_instance_is_done(then: str) -> None:
    with instances(2) as comm:
        if comm is None:
            return
        rt = Runtime(replication=4, comm=comm, timeout=60)
        skips = rt.instance_index == 1

        def step(ctx):  # type: ignore[no-untyped-def]
            if not skips:
                ops.replicated_all_reduce(np.ones(3))

        if skips:
            rt.run(step)  # finishes without the collective, then is done with its runtime
            if then == "close":
                rt.close()
            else:
                del rt
                gc.collect()  # collected (or the interpreter exits): the same notice
            return
        t = time.monotonic()
        with pytest.raises(PeerClosed) as info:
            rt.run(step)
        assert time.monotonic() - t < 20  # not the 60 s timeout
        msg = str(info.value)
        assert "replicated_all_reduce #1" in msg
        assert "instance 1 (replicas 2-3) closed its Runtime while this instance waited for it" in msg
        with pytest.raises(CollectiveError, match="create a new Runtime"):
            rt.run(step)
        rt.close()


@pytest.mark.mpi(min_size=2)
def test_instance_that_never_arrives_is_named() -> None:
    with instances(2) as comm:
        if comm is None:
            return
        with Runtime(replication=4, comm=comm, timeout=1.0) as rt:
            late = rt.instance_index == 1

            def step(ctx):  # type: ignore[no-untyped-def]
                if not late:
                    ops.replicated_all_reduce(np.ones(3))

            if late:
                rt.run(step)  # finishes without the collective, keeps its runtime open until told
                comm.recv(source=0, tag=GAVE_UP)
            else:
                t = time.monotonic()
                try:
                    with pytest.raises(CollectiveTimeoutError) as info:
                        rt.run(step)
                finally:
                    comm.send(None, dest=1, tag=GAVE_UP)
                assert 0.9 < time.monotonic() - t < 20
                msg = str(info.value)
                assert "instance 1 (replicas 2-3) did not arrive within 1 s" in msg
                assert "replicated_all_reduce #1" in msg


@pytest.mark.mpi(min_size=2)
def test_runtime_from_the_popdist_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    w = world()
    L = 2
    for name, value in {
        "POPDIST_NUM_TOTAL_REPLICAS": L * w.size,
        "POPDIST_NUM_LOCAL_REPLICAS": L,
        "POPDIST_REPLICA_INDEX_OFFSET": L * w.rank,
        "POPDIST_NUM_INSTANCES": w.size,
        "POPDIST_INSTANCE_INDEX": w.rank,
    }.items():
        monkeypatch.setenv(name, str(value))
    with Runtime(timeout=60) as rt:
        assert (rt.replication_factor, rt.instance_replication_factor, rt.replica_index_offset) == (
            L * w.size, L, L * w.rank)
        got = rt.run(lambda ctx: ops.replicated_all_reduce(np.array([ctx.replica_index])))
        assert got.tolist() == [[sum(range(L * w.size))]] * L
        with pytest.raises(ValueError, match="contradicts the PopDist environment"):
            Runtime(replication=L)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n", [8, 200_000])
def test_instance_arriving_after_the_others_gave_up_does_not_hang(n: int) -> None:
    with instances(2) as comm:
        if comm is None:
            return
        with Runtime(replication=4, comm=comm, timeout=1.0) as rt:
            late = rt.instance_index == 1
            # The late instance is held back by a message, not a sleep: instance 0 sends it only
            # after its own run has failed, so instance 1 arrives after the others gave up however
            # slowly the ranks are scheduled (a message on the test's communicator, not the runtime's).
            gate = threading.Lock()
            released: list[bool] = []

            def wait_until_instance_0_gave_up() -> None:
                with gate:  # one replica receives; under threads the others wait here, not in the collective
                    if not released:
                        comm.recv(source=0, tag=GAVE_UP)
                        released.append(True)

            def step(ctx):  # type: ignore[no-untyped-def]
                if late:  # the whole instance is late (all its replicas)
                    wait_until_instance_0_gave_up()
                return ops.replicated_all_reduce(np.ones(n, np.float32))

            t = time.monotonic()
            if not late:
                try:
                    with pytest.raises(CollectiveTimeoutError, match=r"instance 1 .* did not arrive"):
                        rt.run(step)
                finally:  # whatever happened here, instance 1 must not wait for ever
                    comm.send(None, dest=1, tag=GAVE_UP)
            elif n > 1000:  # bulk: the early instance's header is there, its data never comes
                with pytest.raises(CollectiveTimeoutError, match="data exchange with instance 0"):
                    rt.run(step)
            else:  # eager: the early instance's header carried its data, but at the end of the step
                with pytest.raises(PeerAborted, match=r"instance 0 .* abandoned"):  # its abort notice is seen
                    rt.run(step)
            assert time.monotonic() - t < 20
            # both are out of step now; the next run brings them back in step first
            assert rt.run(lambda ctx: ops.replicated_all_reduce(np.ones(2))).tolist() == [[4.0] * 2] * 2


@pytest.mark.mpi(min_size=2)
def test_different_numbers_of_collectives_are_reported_at_once() -> None:
    with instances(2) as comm:
        if comm is None:
            return
        with Runtime(replication=4, comm=comm, timeout=60) as rt:
            extra = rt.instance_index == 1

            def step(ctx):  # type: ignore[no-untyped-def]
                x = ops.replicated_all_reduce(np.ones(2))
                if extra:
                    x = ops.replicated_all_reduce(x)
                return x

            t = time.monotonic()
            with pytest.raises(CollectiveMismatchError) as info:
                rt.run(step)
            assert time.monotonic() - t < 20  # not the 60 s timeout
            msg = str(info.value)
            assert "instance 0 (replicas 0-1) end of step (after 1 collective)" in msg
            assert "instance 1 (replicas 2-3) replicated_all_reduce #2 of the step" in msg
            # every instance raised the same error: still in step, still usable
            assert rt.run(lambda ctx: ops.replicated_all_reduce(np.ones(1)))[0, 0] == 4
            # steps without collectives need not run everywhere
            if rt.instance_index == 0:
                rt.run(lambda ctx: None)
            assert rt.run(lambda ctx: ops.replicated_all_reduce(np.ones(1)))[0, 0] == 4


@pytest.mark.mpi(min_size=2)
def test_explicit_communicator_must_split_the_replicas_evenly() -> None:
    w = world()
    bad = w.size + 1
    with pytest.raises(ValueError, match=f"replication={bad} cannot be split evenly over the communicator's {w.size}"):
        Runtime(replication=bad, comm=w)
    with Runtime(comm=w, timeout=60) as rt:  # no PopDist environment: one replica per rank
        assert (rt.replication_factor, rt.instance_replication_factor, rt.instance_index) == (w.size, 1, w.rank)


@pytest.mark.mpi(min_size=2)
@pytest.mark.determinism
def test_large_collectives_in_slices_equal_one_process_for_every_split() -> None:
    """Regions and partials of collectives that span instances, cut into slices on 3 threads,
    give the bits of one process reducing on one thread."""
    replicas, n = 4, (1 << 20) + 37
    x = wild(np.random.default_rng(5), (replicas, n))
    rts = ReplicaGrouping.create(replicas, 1, 2)

    def step(ctx: StepContext, xi: np.ndarray) -> tuple[np.ndarray, ...]:
        shard = ops.replicated_reduce_scatter(xi, op="add", configure_output_for_replicated_tensor_sharding=True)
        return (ops.replicated_all_reduce(xi, op="mean"), ops.replicated_all_reduce(xi, op="add", group=rts),
                ops.replicated_reduce_scatter(xi, op="add"), shard, ops.replicated_all_gather(shard))

    with Runtime(replication=replicas, threads=1) as rt:
        expect = rt.run(step, x)
    for count in splits(replicas):
        with instances(count) as comm:
            if comm is None:
                continue
            with Runtime(replication=replicas, comm=comm, timeout=60, threads=3) as rt:
                slicer = rt.dispatcher.slicer
                assert slicer is not None
                slicer.min_bytes = 1 << 20  # a few MiB in several slices
                got = rt.run(step, x[rt.replica_index_offset:][: rt.instance_replication_factor])
                assert slicer.split_runs > 0
                offset = rt.replica_index_offset
            for a, b in zip(got, expect, strict=True):  # each output stacked over the local replicas
                assert a.tobytes() == b[offset : offset + len(a)].tobytes(), f"{count} x {replicas // count}"
