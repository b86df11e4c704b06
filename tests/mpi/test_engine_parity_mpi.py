"""PopXL collective parity across instances (``mpiexec -n 2|3|4 python -m pytest --with-mpi``).

The new ops (all-gather output shapes, replicated_slice, square_add/and/or, the in-place
all-reduce) and variables and collectives over irregular groupings give bitwise the same results
in one process and in every split of the replicas into instances; a checkpoint of irregular
variables written by one split is read by another.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from popdist_py.engine import ReplicaGrouping, Runtime, ops
from tests.engine_helpers import instances, on_every_split, shared_dir, valid_groupings, wild, world

pytestmark = pytest.mark.engine  # under both executors (tests/conftest.py)

#: Irregular assignments (no constant stride) per replica count.
IRREGULAR: dict[int, list[tuple[int, ...]]] = {4: [(0, 1, 1, 0)], 6: [(0, 1, 1, 0, 2, 2)],
                                              8: [(0, 0, 1, 1, 0, 0, 1, 1), (0, 1, 2, 3, 3, 2, 1, 0)]}


def groupings(n: int) -> list[ReplicaGrouping]:
    return valid_groupings(n) + [ReplicaGrouping.from_assignments(a) for a in IRREGULAR[n]]


def parity_step(R: int):  # type: ignore[no-untyped-def]
    """Every new op over every grouping, at eager and bulk sizes."""
    groups = groupings(R)

    def step(ctx, small, big, flags):  # type: ignore[no-untyped-def]
        out = []
        for rg in groups:
            for x in (small, big):
                out.append(ops.replicated_all_reduce(x, op="square_add", group=rg))
                out.append(ops.replicated_reduce_scatter(x, op="square_add", group=rg))
                out.append(ops.replicated_all_reduce_(x.copy(), op="mean", group=rg))
                out.append(ops.replicated_all_reduce(x, group=rg))
            out.append(ops.replicated_all_reduce(flags, op="and", group=rg))
            out.append(ops.replicated_all_reduce(flags, op="or", group=rg))
            out.append(ops.replicated_reduce_scatter(flags, op="or", group=rg))
            out.append(ops.replicated_all_gather(small, group=rg, output_shape="new_axis").reshape(-1))
            out.append(ops.replicated_all_gather(big, group=rg, output_shape="concat"))
            out.append(ops.replicated_slice(np.repeat(small, rg.group_size, axis=0), group=rg))
            sharded = ops.replicated_reduce_scatter(big, op="square_add", group=rg,
                                                    configure_output_for_replicated_tensor_sharding=True)
            out.append(ops.replicated_all_gather(sharded, output_shape="meta_shape"))
        return tuple(out)

    return step


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("replicas", [4, 6, 8])
def test_new_ops_are_bitwise_the_same_in_every_split(replicas: int) -> None:
    rng = np.random.default_rng(replicas)
    small = wild(rng, (replicas, 3, 5))
    big = wild(rng, (replicas, 9001))  # 36 KB: above the eager limit, odd so chunks are uneven
    flags = rng.random((replicas, 20000)) < 0.9
    step = parity_step(replicas)

    def body(rt: Runtime) -> tuple[np.ndarray, ...]:
        off, L = rt.replica_index_offset, rt.instance_replication_factor
        outputs: tuple[np.ndarray, ...] = rt.run(step, small[off : off + L], big[off : off + L], flags[off : off + L])
        return outputs

    on_every_split(replicas, body)


def irregular_state(rt: Runtime, R: int) -> list[Any]:
    """Variables over an irregular grouping (plain in both retrieval modes, sharded, remote)."""
    rg = rt.replica_grouping_from_assignments(IRREGULAR[R][0])
    host = np.arange(rg.num_groups * 6, dtype=np.float32).reshape(rg.num_groups, 2, 3)
    buf = rt.remote_buffer((2, 3), np.float32)
    return [rt.variable(host, replica_grouping=rg, name="one"),
            rt.variable(host, replica_grouping=rg, retrieval_mode="all_replicas", name="every"),
            rt.replica_sharded_variable(host, replica_grouping=rg, name="sharded")[0],
            rt.remote_variable(host, buf, 0, replica_grouping=rg, name="remote")]


def train_irregular(rt: Runtime, vs: list[Any], steps: int) -> list[np.ndarray]:
    one, every, sharded, remote = vs
    rg = one.replica_grouping
    buf = remote.remote_buffer

    def step(ctx):  # type: ignore[no-untyped-def]
        ctx[one] = ops.replicated_all_reduce(ctx[one] + ctx.replica_index, op="mean", group=rg)
        ctx[every] = ctx[every] * 1.5 + ctx.replica_index
        full = ops.replicated_all_gather(sharded.shard)
        ctx[sharded.shard] = ops.replica_sharded_slice(full * 0.5 + 1, group=rg)
        ops.remote_store(buf, 0, ops.remote_load(buf, 0) + ops.replicated_all_reduce(ctx[one], "square_add", rg))

    for _ in range(steps):
        rt.run(step)
    return [rt.get_tensor_data(v) for v in vs]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("replicas", [4, 6, 8])
def test_irregular_variables_are_the_same_in_every_split(replicas: int) -> None:
    on_every_split(replicas, lambda rt: train_irregular(rt, irregular_state(rt, replicas), 3))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("saver, loader", [(1, 2), (2, 1), (2, 2)])
def test_checkpoints_of_irregular_variables_move_between_splits(saver: int, loader: int) -> None:
    R = 4
    with shared_dir() as d:
        path = d / "ck.npz"
        want = None
        with instances(saver) as comm:
            if comm is not None:
                with Runtime(replication=R, comm=comm if saver > 1 else None, timeout=60) as rt:
                    want = train_irregular(rt, irregular_state(rt, R), 2)
                    rt.save(path)
        want = world().bcast(want if world().rank == 0 else None, root=0)
        with instances(loader) as comm:
            if comm is not None:
                with Runtime(replication=R, comm=comm if loader > 1 else None, timeout=60) as rt:
                    vs = irregular_state(rt, R)
                    rt.load(path)
                    got = [rt.get_tensor_data(v) for v in vs]
                    for g, e in zip(got, want, strict=True):
                        assert g.tobytes() == e.tobytes()
