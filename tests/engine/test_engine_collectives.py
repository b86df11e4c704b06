"""Collectives in one process, against numpy references and the canonical reduction order."""

from __future__ import annotations

import math

import numpy as np
import pytest

from popdist_py.engine import CommGroup, ReplicaGrouping, Runtime, ops
from tests.engine_helpers import valid_groupings


def tree(values: list[np.ndarray], fn=np.add):  # type: ignore[no-untyped-def]
    """Canonical order, restated independently: split at the largest power of two below the count."""
    n = len(values)
    if n == 1:
        return values[0]
    p = 1
    while p * 2 < n:
        p *= 2
    return fn(tree(values[:p], fn), tree(values[p:], fn))


REF = {
    "add": lambda v: tree(v),
    "mul": lambda v: tree(v, np.multiply),
    "min": lambda v: tree(v, np.minimum),
    "max": lambda v: tree(v, np.maximum),
    "mean": lambda v: tree(v) / v[0].dtype.type(len(v)),
}


def wild(rng: np.random.Generator, shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
    if np.dtype(dtype).kind == "i":
        return rng.integers(-5, 6, shape).astype(dtype)
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 5, shape)).astype(dtype)


def per_replica_reference(x: np.ndarray, rg: ReplicaGrouping, fn) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    out: list[np.ndarray] = [None] * rg.num_replicas  # type: ignore[list-item]
    for members in rg.groups:
        value = fn([x[m] for m in members])
        for k, m in enumerate(members):
            out[m] = value(k) if callable(value) else value
    return out


@pytest.mark.determinism
@pytest.mark.parametrize("L", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("op", ["add", "mean", "mul", "min", "max"])
def test_all_reduce_every_grouping_bitwise(L: int, op: str) -> None:
    rng = np.random.default_rng(L)
    x = wild(rng, (L, 5, 3))
    with Runtime(replication=L, timeout=30) as rt:
        for rg in valid_groupings(L):
            got = rt.run(lambda ctx, xi, rg=rg: ops.replicated_all_reduce(xi, op=op, group=rg), x)
            expect = per_replica_reference(x, rg, REF[op])
            for r in range(L):
                assert got[r].dtype == x.dtype
                assert got[r].tobytes() == expect[r].tobytes(), (rg, r)


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int64, np.float16, np.complex64])
def test_all_reduce_dtypes(dtype) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(2)
    x = wild(rng, (4, 7), np.float32).astype(dtype) if np.dtype(dtype).kind != "i" else wild(rng, (4, 7), dtype)
    with Runtime(replication=4) as rt:
        got = rt.run(lambda ctx, xi: ops.replicated_all_reduce(xi), x)
    assert got.dtype == x.dtype
    assert all(got[r].tobytes() == tree(list(x)).tobytes() for r in range(4))


def test_all_reduce_scalar_and_empty() -> None:
    with Runtime(replication=3) as rt:
        got = rt.run(lambda ctx, xi: ops.replicated_all_reduce(xi), np.array([1.0, 2.0, 3.0]))
        assert got.tolist() == [6.0, 6.0, 6.0]
        empty = rt.run(lambda ctx, xi: ops.replicated_all_reduce(xi, op="max"), np.zeros((3, 0, 2)))
        assert empty.shape == (3, 0, 2)


def test_shared_results_are_read_only() -> None:
    """all-reduce and all-gather results may be shared by local replicas, so they are read-only."""
    with Runtime(replication=4) as rt:
        def step(ctx, x):  # type: ignore[no-untyped-def]
            y = ops.replicated_all_reduce(x)
            g = ops.replicated_all_gather(x)
            s = ops.replicated_reduce_scatter(x)
            assert not y.flags.writeable and not g.flags.writeable
            with pytest.raises(ValueError, match="read-only"):
                y += 1
            s += ctx.local_index  # reduce-scatter slices are private to each replica
            return y + ctx.local_index, s

        y, s = rt.run(step, np.ones((4, 4)))
        assert y[:, 0].tolist() == [4, 5, 6, 7]
        assert s[:, 0].tolist() == [4, 5, 6, 7]


def test_inputs_are_not_modified() -> None:
    x = np.arange(8.0).reshape(4, 2)
    before = x.copy()
    with Runtime(replication=4) as rt:
        rt.run(lambda ctx, xi: (ops.replicated_all_reduce(xi), ops.replicated_reduce_scatter(xi)), x)
    assert np.array_equal(x, before)


def test_determinism_is_not_vacuous() -> None:
    """A left-to-right sum of these inputs differs from the canonical tree, which the engine matches."""
    rng = np.random.default_rng(7)
    x = wild(rng, (8, 1000))
    seq = x[0].copy()
    for r in range(1, 8):
        seq = seq + x[r]
    with Runtime(replication=8) as rt:
        got = rt.run(lambda ctx, xi: ops.replicated_all_reduce(xi), x)
    assert got[0].tobytes() == tree(list(x)).tobytes()
    assert got[0].tobytes() != seq.tobytes()


@pytest.mark.parametrize("L", [1, 2, 4, 8])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_all_gather_concatenates_members(L: int, axis: int) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((L, 2, 3)).astype(np.float32)
    with Runtime(replication=L) as rt:
        for rg in valid_groupings(L):
            got = rt.run(lambda ctx, xi, rg=rg: ops.replicated_all_gather(xi, axis=axis, group=rg), x)
            for members in rg.groups:
                expect = np.concatenate([x[m] for m in members], axis=axis)
                for m in members:
                    assert np.array_equal(got[m], expect)


def test_all_gather_scalars_and_bad_axis() -> None:
    with Runtime(replication=4) as rt:
        got = rt.run(lambda ctx, xi: ops.replicated_all_gather(xi), np.arange(4.0))
        assert got.shape == (4, 4) and got[2].tolist() == [0.0, 1.0, 2.0, 3.0]
        with pytest.raises(ValueError, match="axis=2"):
            rt.run(lambda ctx, xi: ops.replicated_all_gather(xi, axis=2), np.zeros((4, 3, 3)))
        with pytest.raises(TypeError, match=r"replicated_all_gather: axis must be an integer, got 1\.5"):
            rt.run(lambda ctx, xi: ops.replicated_all_gather(xi, axis=1.5),  # type: ignore[arg-type]  # refused
                   np.zeros((4, 3, 3)))


@pytest.mark.parametrize("L", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 8, 30])
@pytest.mark.parametrize("op", ["add", "max", "mean"])
def test_reduce_scatter_slices_and_padding(L: int, n: int, op: str) -> None:
    rng = np.random.default_rng(n)
    x = wild(rng, (L, n))
    with Runtime(replication=L) as rt:
        for rg in valid_groupings(L):
            got = rt.run(lambda ctx, xi, rg=rg: ops.replicated_reduce_scatter(xi, op=op, group=rg), x)
            G = rg.group_size
            c = math.ceil(n / G)
            assert got.shape == (L, c)
            for members in rg.groups:
                full = np.zeros(G * c, np.float32)
                full[:n] = REF[op]([x[m] for m in members])
                for k, m in enumerate(members):
                    assert got[m].tobytes() == full[k * c : (k + 1) * c].tobytes()


def test_reduce_scatter_flattens() -> None:
    x = np.arange(4 * 6, dtype=np.float64).reshape(4, 2, 3)
    with Runtime(replication=4) as rt:
        got = rt.run(lambda ctx, xi: ops.replicated_reduce_scatter(xi), x)
    assert got.shape == (4, 2)
    assert got.reshape(-1)[:6].tolist() == x.sum(0).reshape(-1).tolist()
    assert got.reshape(-1)[6:].tolist() == [0, 0]


def test_replica_sharded_slice() -> None:
    x = np.arange(30, dtype=np.float32)
    with Runtime(replication=4) as rt:
        got = rt.run(lambda ctx: ops.replica_sharded_slice(x))
        assert got.shape == (4, 8)
        # RTS layout: balanced padding, the last two shards end with one zero each.
        assert got.tolist() == [x[0:8].tolist(), x[8:16].tolist(), [*x[16:23].tolist(), 0], [*x[23:30].tolist(), 0]]
        rg = rt.replica_grouping(stride=2)
        got = rt.run(lambda ctx: ops.replica_sharded_slice(x, group=rg))
        assert got.shape == (4, 15)
        assert got[0].tolist() == got[1].tolist() == x[:15].tolist()
        assert got[2].tolist() == got[3].tolist() == x[15:].tolist()


def test_comm_groups_and_groups_of_other_sizes() -> None:
    x = np.arange(8.0)
    with Runtime(replication=8) as rt:
        got = rt.run(lambda ctx, xi: ops.replicated_all_reduce(xi, group=CommGroup.orthogonal(2)), x)
        assert got.tolist() == [4, 6, 8, 10, 4, 6, 8, 10]
        got = rt.run(lambda ctx, xi: ops.replicated_all_reduce(xi, group=CommGroup.consecutive(4)), x)
        assert got.tolist() == [6] * 4 + [22] * 4
        with pytest.raises(ValueError, match="replication_factor=8"):
            rt.run(lambda ctx, xi: ops.replicated_all_reduce(xi, group=ReplicaGrouping.create(4)), x)
        with pytest.raises(TypeError, match="group must be"):
            rt.run(lambda ctx, xi: ops.replicated_all_reduce(xi, group=2), x)  # type: ignore[arg-type]


def test_bad_ops_are_named() -> None:
    with Runtime(replication=2) as rt:
        with pytest.raises(ValueError, match=r"op='avg'.*add, mean, mul, min, max.*sum for add, prod for mul"):
            rt.run(lambda ctx: ops.replicated_all_reduce(np.zeros(1), op="avg"))
        with pytest.raises(TypeError, match=r"mean.*int64"):
            rt.run(lambda ctx: ops.replicated_all_reduce(np.zeros(1, np.int64), op="mean"))
        with pytest.raises(TypeError, match="dtype object"):
            rt.run(lambda ctx: ops.replicated_all_reduce(np.array([None])))


@pytest.mark.parametrize("alias, name", [("sum", "add"), ("prod", "mul")])
def test_host_collective_op_names_mean_the_same_op(alias: str, name: str) -> None:
    """``sum``/``prod`` (the host collectives' names) are ``add``/``mul``: same bits, and replicas
    that spell the op differently are in the same collective."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 7)).astype(np.float32)
    with Runtime(replication=4) as rt:
        for op in (ops.replicated_all_reduce, ops.replicated_reduce_scatter):
            want = rt.run(lambda ctx, xi, op=op: op(xi, op=name), x)
            got = rt.run(lambda ctx, xi, op=op: op(xi, op=alias), x)
            assert got.tobytes() == want.tobytes()
        mixed = rt.run(lambda ctx, xi: ops.replicated_all_reduce(xi, op=alias if ctx.replica_index % 2 else name), x)
        assert mixed.tobytes() == rt.run(lambda ctx, xi: ops.replicated_all_reduce(xi, op=name), x).tobytes()


def test_many_collectives_in_one_step() -> None:
    with Runtime(replication=4) as rt:
        def step(ctx, x):  # type: ignore[no-untyped-def]
            for _ in range(200):
                x = ops.replicated_all_reduce(x, op="mean")
                x = x + ctx.local_index
            return x

        got = rt.run(step, np.zeros((4, 3)))
        assert np.allclose(got - np.arange(4)[:, None], got[0, 0])


def test_shared_results_come_back_from_run_without_copies() -> None:
    with Runtime(replication=4) as rt:
        out = rt.run(lambda ctx, x: ops.replicated_all_reduce(x), np.ones((4, 1000)))
        assert out.shape == (4, 1000) and not out.flags.writeable and out.strides[0] == 0
        assert np.all(out == 4)
        private = rt.run(lambda ctx, x: ops.replicated_all_reduce(x) + 0, np.ones((4, 3)))
        assert private.flags.writeable and private.strides[0] != 0
