"""RTS, remote buffers and checkpoints across instances (``mpiexec -n 2|3|4 python -m pytest --with-mpi``).

Every test runs the same replicas in one process and as 2, 3, ... instances over sub-communicators
of COMM_WORLD, and requires bitwise-identical results; checkpoints written by one split are read
by another.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from popdist_py.engine import CheckpointError, CommGroup, ReplicaGrouping, Runtime, ops
from tests.engine_helpers import (
    instances,
    load_script,
    on_every_split,
    shared_dir,
    valid_groupings,
    wild,
    world,
)

pytestmark = pytest.mark.engine  # under both executors (tests/conftest.py)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "engine_checkpoint.py"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("replicas", [4, 6, 8])
def test_rts_collectives_match_one_process(replicas: int) -> None:
    rng = np.random.default_rng(replicas)
    small = wild(rng, (replicas, 5, 7))
    big = wild(rng, (replicas, 9001))  # above the eager limit, uneven over every group size
    groups = valid_groupings(replicas)

    def body(rt: Runtime) -> list[np.ndarray]:
        off, L = rt.replica_index_offset, rt.instance_replication_factor

        def step(ctx, s, b):  # type: ignore[no-untyped-def]
            out = []
            for rg in groups:
                for x in (s, b):
                    for op in ("add", "mean"):
                        rs = ops.replicated_reduce_scatter(x, op=op, group=rg,
                                                           configure_output_for_replicated_tensor_sharding=True)
                        out += [rs, ops.replicated_all_gather(rs).reshape(-1)]
                out.append(ops.replica_sharded_slice(s, group=rg))
                out.append(ops.replicated_all_gather(ops.replica_sharded_slice(b, group=rg)))
            return tuple(out)

        return list(rt.run(step, small[off : off + L], big[off : off + L]))

    on_every_split(replicas, body)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("replicas", [4, 6])
def test_sharded_variables_and_domains_across_instances(replicas: int) -> None:
    data = np.arange(1, 51, dtype=np.float32).reshape(5, 10)

    def body(rt: Runtime) -> list[np.ndarray]:
        R = rt.replication_factor
        made = [rt.replica_sharded_variable(data, name="all")]  # shards spread over every instance
        made.append(rt.replica_sharded_variable(data, shard_over=CommGroup.consecutive(2), name="pairs"))
        made.append(rt.replica_sharded_variable(data, shard_over=R // 2, name="halves"))
        orth = rt.replica_grouping(stride=2)
        made.append(rt.replica_sharded_variable(np.stack([data, -data]), replica_grouping=orth, name="orth"))
        out: list[np.ndarray] = []
        for full, shard in made:
            out.append(rt.get_tensor_data(full))
            gathered = rt.run(lambda ctx, shard=shard: ops.replicated_all_gather(shard))
            out.append(np.asarray(gathered))

            def update(ctx, shard=shard):  # type: ignore[no-untyped-def]
                ctx[shard] = ctx[shard] * np.float32(ctx.replica_index + 1)

            rt.run(update)
            out.append(rt.get_tensor_data(full))
            rt.write_variable_data(full, rt.get_tensor_data(full) + 1)
            out.append(rt.get_tensor_data(full))
        return out

    on_every_split(replicas, body)


@pytest.mark.mpi(min_size=2)
def test_per_instance_domain_keeps_every_shard_in_its_instance() -> None:
    """PopART's ``CommGroup(Consecutive, L)`` domain: each instance holds a complete copy in its shards."""
    data = np.arange(1, 31, dtype=np.float32).reshape(5, 6)
    with instances(2) as comm:
        if comm is None:
            return
        with Runtime(replication=4, comm=comm, timeout=60) as rt:
            L = rt.instance_replication_factor
            full, shard = rt.replica_sharded_variable(data, shard_over=CommGroup.consecutive(L))
            assert shard.domain == ReplicaGrouping.create(4, 1, L)
            mine = rt.get_replica_data(full)  # no communication: this instance's shards
            assert np.array_equal(shard.meta.layout.join(mine).reshape(5, 6), data)
            got = rt.run(lambda ctx: ops.replicated_all_gather(shard))
            assert all(np.array_equal(g, data) for g in got)
            plans = rt.dispatcher.plans()
            assert plans and not any(p.cross for p in plans)  # the gather never left the instance
            assert np.array_equal(rt.get_tensor_data(full), data)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("replicas", [4, 6])
@pytest.mark.parametrize("rts", [False, True])
def test_training_with_rts_and_remote_state_matches_one_process(replicas: int, rts: bool) -> None:
    script = load_script(SCRIPT)

    def body(rt: Runtime) -> list[np.ndarray]:
        vs = script.build(rt, rts, 0)
        script.train(rt, vs, rts, 3, 0)
        return [np.frombuffer(script.digest(rt).encode(), np.uint8)]

    with Runtime(replication=replicas) as rt:  # RTS is the sharded form of the replicated training
        vs = script.build(rt, not rts, 0)
        script.train(rt, vs, not rts, 3, 0)
        other = script.digest(rt)
    on_every_split(replicas, body)
    with Runtime(replication=replicas) as rt:
        assert body(rt)[0].tobytes() == other.encode()


@pytest.mark.mpi(min_size=2)
def test_remote_slots_per_replica_across_instances() -> None:
    def body(rt: Runtime) -> list[np.ndarray]:
        R = rt.replication_factor
        buf = rt.remote_buffer((3,), np.int64, entries=2, location="file")
        v = rt.remote_variable(np.arange(R * 3).reshape(R, 3), buf, 1,
                               replica_grouping=rt.replica_grouping(group_size=1), name="v")

        def step(ctx):  # type: ignore[no-untyped-def]
            x = ops.remote_load(buf, 1)
            ops.remote_store(buf, 1, x * 10 + ctx.replica_index)
            return ops.remote_load(buf, 1)

        return [rt.run(step), rt.get_tensor_data(v), rt.get_replica_data(v)]

    on_every_split(4, body)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("saver, loader", [(1, 2), (2, 1), (2, 2)])
def test_checkpoints_move_between_splits(saver: int, loader: int) -> None:
    """Saved by ``saver`` instances (RTS over all replicas), loaded by ``loader`` instances without RTS."""
    script = load_script(SCRIPT)
    R = 4
    with shared_dir() as d:
        path = d / "ck.npz"
        with instances(saver) as comm:
            if comm is not None:
                with Runtime(replication=R, comm=comm if saver > 1 else None, timeout=60) as rt:
                    vs = script.build(rt, True, 0)
                    script.train(rt, vs, True, 2, 0)
                    rt.save(path, {"steps": 2})
                    want = script.digest(rt)
        want = world().bcast(want if world().rank == 0 else None, root=0)
        with instances(loader) as comm:
            if comm is not None:
                with Runtime(replication=R, comm=comm if loader > 1 else None, timeout=60) as rt:
                    vs = script.build(rt, False, 0)
                    assert rt.load(path) == {"steps": 2}
                    assert script.digest(rt) == want
                    rt.variable(np.zeros(3), name="not_saved")
                    with pytest.raises(CheckpointError, match="missing from the checkpoint: 'not_saved'"):
                        rt.load(path)  # the same verdict on every instance: no hang


@pytest.mark.mpi(min_size=2)
def test_bad_checkpoints_and_failed_saves_raise_on_every_instance() -> None:
    with shared_dir() as d, instances(2) as comm:
        if comm is None:
            return
        with Runtime(replication=4, comm=comm, timeout=30) as rt:
            w, _ = rt.replica_sharded_variable(np.arange(10.0), name="w")
            rt.save(d / "good.npz")
            if rt.instance_index == 0:
                (d / "bad.npz").write_bytes((d / "good.npz").read_bytes()[:100])
            with pytest.raises(CheckpointError, match=r"bad\.npz is not a readable checkpoint"):
                rt.load(d / "bad.npz")  # only instance 0 reads; both raise, neither hangs
            with pytest.raises(CheckpointError, match="no checkpoint at"):
                rt.load(d / "missing.npz")
            with pytest.raises(OSError, match="could not create a temporary file"):
                rt.save(d / "no-such-dir" / "x.npz")
            # still in step: a good load works afterwards
            rt.write_variable_data(w, np.zeros(10))
            rt.load(d / "good.npz")
            assert rt.get_tensor_data(w).tolist() == list(range(10))
            assert sorted(os.listdir(d)) == ["bad.npz", "good.npz"]
