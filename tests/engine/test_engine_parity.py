"""PopXL collective parity: all-gather output shapes, replicated_slice, the ops square_add/and/or,
the in-place all-reduce, and groupings from assignments (irregular ones included), in one process
against numpy references. Across instances: tests/mpi/test_engine_parity_mpi.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from popdist_py.engine import CheckpointError, CollectiveMismatchError, CommGroup, ReplicaGrouping, Runtime, ops
from popdist_py.engine._collectives.reduce import ALL_OPS, reduce_sequence
from popdist_py.op_names import ENGINE_OPS
from tests.engine_helpers import valid_groupings

R = 4
#: Assignments of 4 and 8 replicas that no (stride, group_size) describes.
IRREGULAR: dict[int, list[tuple[int, ...]]] = {
    4: [(0, 1, 1, 0)], 8: [(0, 0, 1, 1, 0, 0, 1, 1), (0, 1, 2, 3, 3, 2, 1, 0), (0, 1, 1, 0, 2, 3, 3, 2)]}


def groupings(n: int) -> list[ReplicaGrouping]:
    """Every (stride, group_size) grouping of n replicas and the irregular ones above."""
    return valid_groupings(n) + [ReplicaGrouping.from_assignments(a) for a in IRREGULAR.get(n, [])]


def wild(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 5, shape)).astype(np.float32)


def per_member(rg: ReplicaGrouping, x: np.ndarray, f: Callable[[list[np.ndarray]], object]) -> list[Any]:
    """``f(members' inputs in member order)`` for every replica, in replica order (the reference),
    as nested lists."""
    return [np.asarray(f([x[m] for m in rg.members(rg.group_of(r))])).tolist() for r in range(rg.num_replicas)]


# -- all-gather output shapes -------------------------------------------------------------------------
@pytest.mark.parametrize("n", [4, 8])
def test_all_gather_output_shapes_match_numpy(n: int) -> None:
    x = np.random.default_rng(n).standard_normal((n, 3, 2)).astype(np.float32)
    with Runtime(replication=n) as rt:
        for rg in groupings(n):
            def step(ctx, xi, rg=rg):  # type: ignore[no-untyped-def]
                return (ops.replicated_all_gather(xi, group=rg, output_shape="new_axis"),
                        ops.replicated_all_gather(xi, axis=1, group=rg, output_shape="concat"),
                        ops.replicated_all_gather(xi, axis=-1, group=rg),  # auto without meta: concat
                        ops.replicated_all_gather(xi[0, 0], group=rg, output_shape="new_axis"))  # 0-d

            new, cat1, auto, scalar = rt.run(step, x)
            assert new.tolist() == per_member(rg, x, np.stack), rg
            assert cat1.tolist() == per_member(rg, x, lambda v: np.concatenate(v, axis=1)), rg
            assert auto.tolist() == per_member(rg, x, lambda v: np.concatenate(v, axis=-1)), rg
            assert scalar.tolist() == per_member(rg, x[:, 0, 0], np.stack), rg


def test_all_gather_of_a_shard_by_output_shape() -> None:
    data = np.arange(30, dtype=np.float32).reshape(5, 6)
    with Runtime(replication=R) as rt:
        _, shard = rt.replica_sharded_variable(data)

        def step(ctx):  # type: ignore[no-untyped-def]
            s = ctx[shard]
            return (ops.replicated_all_gather(s, output_shape="meta_shape"), ops.replicated_all_gather(s),
                    ops.replicated_all_gather(shard, output_shape="concat"),
                    ops.replicated_all_gather(s, output_shape="new_axis"))

        meta, auto, cat, new = rt.run(step)
    padded = np.zeros(32, np.float32)
    padded[:16], padded[16:23], padded[24:31] = data.reshape(-1)[:16], data.reshape(-1)[16:23], data.reshape(-1)[23:]
    assert meta.shape == auto.shape == (R, 5, 6) and (meta == data).all() and (auto == data).all()
    assert cat.shape == (R, 32) and (cat == padded).all()  # concat of the shards themselves, padding included
    assert new.shape == (R, 4, 8) and (new == padded.reshape(4, 8)).all()


def test_all_gather_bad_output_shapes_are_named() -> None:
    with Runtime(replication=R) as rt:
        x = np.zeros((R, 2), np.float32)
        with pytest.raises(ValueError, match=r"^replicated_all_gather: output_shape='stack' is not valid; use one of "
                                             r"'new_axis', 'concat', 'meta_shape', 'auto'"):
            rt.run(lambda ctx, xi: ops.replicated_all_gather(xi, output_shape="stack"), x)
        with pytest.raises(ValueError, match=r"^replicated_all_gather: output_shape='meta_shape' needs a "
                                             r"replica-sharded input .* got a ndarray of shape \(2,\) "):
            rt.run(lambda ctx, xi: ops.replicated_all_gather(xi, output_shape="meta_shape"), x)
        with pytest.raises(ValueError, match=r"^replicated_all_gather: axis=1 is only for output_shape='concat'"):
            rt.run(lambda ctx, xi: ops.replicated_all_gather(xi, axis=1, output_shape="new_axis"), x)
        assert rt.run(lambda ctx, xi: ops.replicated_all_gather(xi, output_shape="concat"), x).shape == (R, 2 * R)


# -- replicated_slice ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [4, 8])
def test_replicated_slice_matches_numpy_and_undoes_the_gathers(n: int) -> None:
    x = np.arange(2 * n * 3 * n, dtype=np.float64).reshape(2 * n, 3 * n)
    with Runtime(replication=n) as rt:
        for rg in groupings(n):
            G = rg.group_size

            def step(ctx, rg=rg, G=G):  # type: ignore[no-untyped-def]
                a = ops.replicated_slice(x, group=rg)
                b = ops.replicated_slice(x, axis=-1, group=rg)
                c = ops.replicated_slice(x[:G], axis=0, group=rg)  # one row each: the axis is dropped
                back = ops.replicated_all_gather(b, axis=1, group=rg)
                stacked = ops.replicated_all_gather(c, group=rg, output_shape="new_axis")
                a[...] = -1  # private and writable
                return a, b, c, back, stacked

            a, b, c, back, stacked = rt.run(step)
            for r in range(n):
                k = rg.index_in_group(r)
                rows, cols = 2 * n // G, 3 * n // G
                assert b[r].tolist() == x[:, k * cols : (k + 1) * cols].tolist()
                assert c[r].tolist() == x[k].tolist()
                assert a[r].shape == (rows, 3 * n)
            assert (back == x).all() and (stacked == x[:G]).all()


def test_replicated_slice_bad_input_is_named() -> None:
    with Runtime(replication=R) as rt:
        with pytest.raises(ValueError, match=r"^replicated_slice: axis 1 of an input of shape \(4, 6\) has length 6, "
                                             r"which the group size 4 does not divide"):
            rt.run(lambda ctx: ops.replicated_slice(np.zeros((4, 6)), axis=1))
        with pytest.raises(ValueError, match=r"^replicated_slice: axis=2 is out of range for an input of shape "
                                             r"\(4, 6\) \(valid: -2..1\)"):
            rt.run(lambda ctx: ops.replicated_slice(np.zeros((4, 6)), axis=2))
        with pytest.raises(ValueError, match=r"^replicated_slice: x is 0-d"):
            rt.run(lambda ctx: ops.replicated_slice(np.float32(1)))
        with pytest.raises(TypeError, match=r"^replicated_slice: axis must be an integer, got 0.0"):
            rt.run(lambda ctx: ops.replicated_slice(np.zeros(4), axis=0.0))  # type: ignore[arg-type]
        got = rt.run(lambda ctx: ops.replicated_slice(np.arange(6.0), group=CommGroup.consecutive(2)))
        assert got.tolist() == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5]]


# -- square_add, and, or ----------------------------------------------------------------------------------
@pytest.mark.one_executor  # no Runtime
def test_op_names_are_defined_once() -> None:
    assert ALL_OPS == ENGINE_OPS == ("add", "mean", "mul", "min", "max", "square_add", "and", "or")


@pytest.mark.parametrize("n", [4, 8])
def test_square_add_and_logical_ops_match_numpy(n: int) -> None:
    rng = np.random.default_rng(n)
    small, big = wild(rng, (n, 5)), wild(rng, (n, 9001))  # eager and bulk sizes
    ints = rng.integers(-1000, 1000, (n, 7))
    flags = rng.random((n, 3000)) < 0.7
    with Runtime(replication=n) as rt:
        for rg in groupings(n):
            def step(ctx, s, b, i, f, rg=rg):  # type: ignore[no-untyped-def]
                return (ops.replicated_all_reduce(s, "square_add", rg), ops.replicated_all_reduce(b, "square_add", rg),
                        ops.replicated_all_reduce(i, "square_add", rg), ops.replicated_all_reduce(f, "and", rg),
                        ops.replicated_all_reduce(f, "or", rg), ops.replicated_all_reduce(f[:5], "and", rg))

            sq_small, sq_big, sq_int, f_and, f_or, f_and_small = rt.run(step, small, big, ints, flags)
            for got, x in ((sq_small, small), (sq_big, big)):  # the canonical tree: bitwise
                want = [reduce_sequence([x[m] for m in rg.members(rg.group_of(r))], "square_add") for r in range(n)]
                assert got.tobytes() == np.stack(want).tobytes(), rg
                np.testing.assert_allclose(got, per_member(rg, x, lambda v: np.sum(np.square(v), axis=0)), rtol=1e-5)
            assert sq_int.dtype == ints.dtype
            assert sq_int.tolist() == per_member(rg, ints, lambda v: np.sum(np.square(v), axis=0))
            assert f_and.dtype == f_or.dtype == np.bool_
            assert f_and.tolist() == per_member(rg, flags, np.logical_and.reduce)
            assert f_or.tolist() == per_member(rg, flags, np.logical_or.reduce)
            assert f_and_small.tolist() == per_member(rg, flags[:, :5], np.logical_and.reduce)


def test_new_ops_in_reduce_scatter() -> None:
    rng = np.random.default_rng(2)
    x = wild(rng, (R, 30))
    flags = rng.random((R, 30)) < 0.5
    with Runtime(replication=R) as rt:
        def step(ctx, xi, fi):  # type: ignore[no-untyped-def]
            sq = ops.replicated_reduce_scatter(xi, op="square_add")
            rts = ops.replicated_reduce_scatter(xi, "square_add", configure_output_for_replicated_tensor_sharding=True)
            full = ops.replicated_all_reduce(xi, op="square_add")
            both = ops.replicated_reduce_scatter(fi, op="or")
            return sq, rts, ops.replica_sharded_slice(full), ops.replicated_all_gather(rts), full, both

        sq, rts, sliced, gathered, full, both = rt.run(step, x, flags)
    assert sq.reshape(-1)[:30].tobytes() == full[0].tobytes()
    assert rts.tobytes() == sliced.tobytes() and gathered.tobytes() == full.tobytes()
    assert both.reshape(-1)[:30].tolist() == np.logical_or.reduce(flags).tolist()


def test_new_ops_reject_operands_they_are_not_defined_for() -> None:
    with Runtime(replication=R) as rt:
        with pytest.raises(TypeError, match=r"^replicated_all_reduce: op='and' is logical and takes bool inputs only "
                                            r"\(as PopXL's\), got dtype int64; compare first, e\.g\. x != 0"):
            rt.run(lambda ctx: ops.replicated_all_reduce(np.ones(2, np.int64), op="and"))
        with pytest.raises(TypeError, match=r"op='or' .* got dtype float32"):
            rt.run(lambda ctx: ops.replicated_reduce_scatter(np.ones(8, np.float32), op="or"))
        for dt in (np.bool_, np.complex64):
            with pytest.raises(TypeError, match=rf"^replicated_all_reduce: op='square_add' needs an integer or "
                                                rf"floating-point input, got dtype {np.dtype(dt)}"):
                rt.run(lambda ctx, dt=dt: ops.replicated_all_reduce(np.ones(2, dt), op="square_add"))
        with pytest.raises(ValueError, match=r"op='xor' is not supported; use one of add, mean, mul, min, max \(or sum "
                                             r"for add, prod for mul\), square_add \(the sum of squares\), or on bool "
                                             r"inputs and or or"):
            rt.run(lambda ctx: ops.replicated_all_reduce(np.ones(2, bool), op="xor"))
        with pytest.raises(CollectiveMismatchError, match=r"disagree.*(op=add.*op=square_add|op=square_add.*op=add)"):
            rt.run(lambda ctx: ops.replicated_all_reduce(np.ones(2), op="square_add" if ctx.replica_index else "add"))
        assert rt.run(lambda ctx: ops.replicated_all_reduce(np.ones(2))).tolist() == [[R, R]] * R  # still usable


# -- the in-place all-reduce --------------------------------------------------------------------------------
def test_in_place_all_reduce_writes_into_its_input() -> None:
    rng = np.random.default_rng(4)
    x = wild(rng, (R, 3, 4))
    with Runtime(replication=R) as rt:
        full, shard = rt.replica_sharded_variable(np.arange(8, dtype=np.float32))
        for op in ("add", "mean", "max", "square_add"):
            def step(ctx, xi, op=op):  # type: ignore[no-untyped-def]
                mine = xi.copy()
                out = ops.replicated_all_reduce_(mine, op=op, group=CommGroup.consecutive(2))
                return out, mine, np.array(out is mine), ops.replicated_all_reduce(xi, op, CommGroup.consecutive(2))

            out, mine, same, want = rt.run(step, x)
            assert same.all() and out.tobytes() == mine.tobytes() == want.tobytes()
        rt.run(lambda ctx: ops.replicated_all_reduce_(ctx[shard], op="max"))  # a shard is writable: stored in place
        assert rt.get_tensor_data(full).tolist() == [6, 7] * R


def test_in_place_all_reduce_needs_a_writable_array() -> None:
    with Runtime(replication=R) as rt:
        v = rt.variable(np.zeros(3, np.float32), name="v")
        with pytest.raises(ValueError, match=r"^replicated_all_reduce_: x \(shape \(3,\), dtype float32\) is "
                                             r"read-only, as ctx\[var\] and collective results are; reduce a "
                                             r"writable copy"):
            rt.run(lambda ctx: ops.replicated_all_reduce_(ctx[v]))
        with pytest.raises(TypeError, match=r"^replicated_all_reduce_: x must be a numpy array .* got list"):
            rt.run(lambda ctx: ops.replicated_all_reduce_([1.0, 2.0]))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"op='and' is logical"):
            rt.run(lambda ctx: ops.replicated_all_reduce_(np.zeros(2), op="and"))


# -- groupings from assignments ----------------------------------------------------------------------------
@pytest.mark.one_executor
def test_repr_shows_num_groups_or_the_assignment() -> None:
    want = "ReplicaGrouping(num_replicas=8, stride=1, group_size=4, num_groups=2)"
    assert repr(ReplicaGrouping.create(8, 1, 4)) == want
    rg = ReplicaGrouping.from_assignments([0, 1, 1, 0])
    assert repr(rg) == str(rg) == "ReplicaGrouping(num_replicas=4, assignment=[0, 1, 1, 0])"


@pytest.mark.one_executor
@pytest.mark.parametrize("n", [1, 2, 4, 6, 8, 12])
def test_from_assignments_of_constant_strides_gives_the_plain_grouping(n: int) -> None:
    for rg in valid_groupings(n):
        got = ReplicaGrouping.from_assignments(rg.assignment)
        assert got == rg and got.is_const
        # an array for the Sequence[int], accepted at run time
        assert ReplicaGrouping.from_assignment(np.array(rg.assignment)) == rg  # type: ignore[arg-type]


@pytest.mark.one_executor
@pytest.mark.parametrize("a", [a for n in IRREGULAR for a in IRREGULAR[n]])
def test_irregular_groupings_answer_from_their_assignment(a: tuple[int, ...]) -> None:
    rg = ReplicaGrouping.from_assignments(list(a))
    assert not rg.is_const and rg.assignment == a and rg.num_groups == max(a) + 1
    assert rg.group_size * rg.num_groups == len(a)
    for g, members in enumerate(rg.groups):
        assert list(members) == [r for r in range(len(a)) if a[r] == g]
        assert rg.first(g) == members[0] and rg.members(g) == members
        for k, r in enumerate(members):
            assert (rg.group_of(r), rg.index_in_group(r), rg.member(g, k)) == (g, k, r)
    t = rg.transpose()  # the k-th members of every group together
    assert [t.group_of(rg.member(g, k)) for g in range(rg.num_groups) for k in range(rg.group_size)] \
        == [t.group_of(rg.member(0, k)) for g in range(rg.num_groups) for k in range(rg.group_size)]
    assert len({rg: 1, ReplicaGrouping.from_assignments(a): 2}) == 1  # a value: equal and hashable
    with pytest.raises(ValueError, match=r"no CommGroup equivalent: it is irregular"):
        rg.to_comm_group()
    with pytest.raises(ValueError, match=r"^assignment .* is not a constant-stride grouping; "
                                         r"ReplicaGrouping.from_assignments \(plural\) builds irregular groupings$"):
        ReplicaGrouping.from_assignment(a)


@pytest.mark.one_executor
@pytest.mark.parametrize(
    "a, exc, words",
    [
        ([0, 0, 1], ValueError, r"^assignment \[0, 0, 1\]: the groups differ in size \(\{0: 2, 1: 1\}\)"),
        ([1, 0, 1, 0], ValueError, (r"^assignment \[1, 0, 1, 0\]: replica 0 is in group 1, but groups must be "
                                    r"numbered 0, 1, \.\.\. in order of first appearance \(the next new group here "
                                    r"is 0\)$")),
        ([0, 2, 1, 2, 1, 0], ValueError, r"replica 1 is in group 2"),
        ([0, -1], ValueError, r"replica 1 is in group -1"),
        ([], ValueError, r"^assignment \[\] is empty: it needs one group index per replica$"),
        ("0011", TypeError, r"^assignment must be a sequence of group indices"),
        ([0, 0.0], TypeError, r"^assignment entry must be an integer, got 0.0"),
    ],
)
def test_bad_assignments_are_named(a: object, exc: type[Exception], words: str) -> None:
    with pytest.raises(exc, match=words):
        ReplicaGrouping.from_assignments(a)  # type: ignore[arg-type]


def test_runtime_builds_groupings_from_assignments() -> None:
    with Runtime(replication=R) as rt:
        rg = rt.replica_grouping_from_assignments([0, 1, 1, 0])
        assert rg.groups == ((0, 3), (1, 2))
        assert rt.replica_grouping_from_assignments([0, 1, 0, 1]) == rt.replica_grouping(stride=2)
        assert rt.replica_grouping_from_assignment([0, 0, 1, 1]) == rt.replica_grouping(group_size=2)
        with pytest.raises(ValueError, match=r"^group ReplicaGrouping\(num_replicas=2, stride=1, group_size=2, "
                                             r"num_groups=1\) is for 2 replicas but this runtime has "
                                             r"replication_factor=4$"):
            rt.replica_grouping_from_assignments([0, 0])
        with pytest.raises(ValueError, match="not a constant-stride grouping"):
            rt.replica_grouping_from_assignment([0, 1, 1, 0])


# -- variables with irregular groupings ----------------------------------------------------------------------
def test_variables_with_an_irregular_grouping(tmp_path: Path) -> None:
    with Runtime(replication=8) as rt:
        rg = rt.replica_grouping_from_assignments([0, 0, 1, 1, 0, 0, 1, 1])
        host = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
        one = rt.variable(host, replica_grouping=rg, name="one")
        every = rt.variable(host, replica_grouping=rg, retrieval_mode="all_replicas", name="every")
        full, shard = rt.replica_sharded_variable(np.arange(10.0).reshape(2, 5), replica_grouping=rg, name="sharded")
        buf = rt.remote_buffer((2,), np.float32)
        remote = rt.remote_variable(host, buf, 0, replica_grouping=rg, name="remote")
        assert one.shape == (2,) and one.shape_on_host == (2, 2)
        assert full.sharding is not None and full.sharding.domain == rg
        seen = rt.run(lambda ctx: ctx[one])
        assert seen.tolist() == [host[rg.group_of(r)].tolist() for r in range(8)]

        def step(ctx):  # type: ignore[no-untyped-def]
            ctx[one] = ops.replicated_all_reduce(ctx[one], group=rg)  # 4 members: 4 x the group's value
            ctx[every] = ctx[every] + ctx.replica_index
            ctx[shard] = ctx[shard] * 2
            ops.remote_store(buf, 0, ops.remote_load(buf, 0) - 1)
            return ops.replicated_all_gather(shard)

        gathered = rt.run(step)
        assert (gathered == np.arange(10.0).reshape(2, 5)[[rg.group_of(r) for r in range(8)]] * 2).all()
        want = {"one": host * 4, "every": np.stack([host[rg.group_of(r)] + r for r in range(8)]),
                "sharded": np.arange(10.0).reshape(2, 5) * 2, "remote": host - 1}
        values = {v.name: rt.get_tensor_data(v) for v in (one, every, full, remote)}
        for name, value in values.items():
            assert value.tolist() == want[name].tolist(), name
        rt.save(tmp_path / "ck.npz")
        for v in (one, every, full, remote):
            rt.write_variable_data(v, np.zeros(v.shape_on_host if v is not every else (2, 2)))
        assert rt.get_tensor_data(every).tolist() == [[0.0, 0.0]] * 8
        rt.load(tmp_path / "ck.npz")
        for v in (one, every, full, remote):
            assert rt.get_tensor_data(v).tolist() == values[v.name].tolist(), v.name
        with pytest.raises(ValueError, match=r"host data of shape \(3,\) needs a leading axis of 2 \(one value per "
                                             r"group of ReplicaGrouping\(num_replicas=8, assignment="):
            rt.variable(np.zeros(3), replica_grouping=rg)
    with Runtime(replication=8) as rt:  # a checkpoint of an irregular variable restores into the same grouping
        rg = rt.replica_grouping_from_assignments([0, 0, 1, 1, 0, 0, 1, 1])
        again = rt.variable(np.zeros((2, 2), np.float32), replica_grouping=rg, name="one")
        rt.load(tmp_path / "ck.npz", strict=False)
        assert rt.get_tensor_data(again).tolist() == values["one"].tolist()


def test_a_checkpoint_knows_an_irregular_grouping_from_a_regular_one(tmp_path: Path) -> None:
    with Runtime(replication=4) as rt:
        rt.variable(np.zeros((2, 2)), replica_grouping=rt.replica_grouping_from_assignments([0, 1, 1, 0]), name="v")
        rt.save(tmp_path / "ck.npz")
    with Runtime(replication=4) as rt:
        rt.variable(np.zeros((2, 2)), replica_grouping=rt.replica_grouping(group_size=2), name="v")
        with pytest.raises(CheckpointError, match="'v' was saved with replica grouping"):
            rt.load(tmp_path / "ck.npz")


def test_sharding_domains_of_irregular_groupings() -> None:
    with Runtime(replication=8) as rt:
        rg = rt.replica_grouping_from_assignments([0, 0, 1, 1, 0, 0, 1, 1])
        full, shard = rt.replica_sharded_variable(np.arange(10.0).reshape(2, 5), replica_grouping=rg, shard_over=2)
        assert full.sharding is not None and full.sharding.domain == rt.replica_grouping(group_size=2)
        assert rt.run(lambda ctx: ops.replicated_all_gather(shard)).tolist() \
            == [np.arange(10.0).reshape(2, 5)[rg.group_of(r)].tolist() for r in range(8)]
        with pytest.raises(ValueError, match=r"sharding domain .*stride=2.* does not split the variable's groups "
                                             r".* into runs of consecutive members; one that does is "
                                             r"ReplicaGrouping\(num_replicas=8, stride=1, group_size=2"):
            rt.replica_sharded_variable(np.zeros((2, 5)), replica_grouping=rg, shard_over=rt.replica_grouping(2, 2))
        with pytest.raises(ValueError, match=r"shard_over=3 must divide the replica group size 4"):
            rt.replica_sharded_variable(np.zeros((2, 5)), replica_grouping=rg, shard_over=3)
