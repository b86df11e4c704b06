"""Variables in one process: grouping of host data, per-replica state, retrieval modes, names."""

from __future__ import annotations

import numpy as np
import pytest

from popdist_py.engine import CommGroup, Runtime, Variable


def test_default_variable_is_copied_to_every_replica() -> None:
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    with Runtime(replication=4) as rt:
        v = rt.variable(data, name="w")
        data[:] = -1  # the runtime keeps its own copy
        assert isinstance(v, Variable) and v.shape == (2, 3) and v.shape_on_host == (2, 3) and v.dtype == np.float32
        vals = rt.run(lambda ctx: ctx[v])
        assert vals.shape == (4, 2, 3) and np.array_equal(vals[3], np.arange(6).reshape(2, 3))
        assert np.array_equal(rt.get_tensor_data(v), np.arange(6).reshape(2, 3))


@pytest.mark.parametrize("stride, group_size", [(1, 2), (2, 2), (4, 2), (1, 1), (2, 4), (1, 8)])
def test_grouped_variable_values(stride: int, group_size: int) -> None:
    with Runtime(replication=8) as rt:
        rg = rt.replica_grouping(stride, group_size)
        host = np.arange(rg.num_groups * 3, dtype=np.int64).reshape(rg.num_groups, 3)
        v = rt.variable(host if rg.num_groups > 1 else host[0], replica_grouping=rg)
        vals = rt.run(lambda ctx: ctx[v])
        for r in range(8):
            assert vals[r].tolist() == host[rg.group_of(r)].tolist()
        assert np.array_equal(rt.get_tensor_data(v), host if rg.num_groups > 1 else host[0])


def test_retrieval_modes_after_replicas_diverge() -> None:
    with Runtime(replication=4) as rt:
        rg = rt.replica_grouping(stride=2)  # groups {0, 2} and {1, 3}
        one = rt.variable(np.array([[10.0], [20.0]]), replica_grouping=rg, name="one")
        alls = rt.variable(np.array([[10.0], [20.0]]), replica_grouping=rg, retrieval_mode="all_replicas")

        def step(ctx):  # type: ignore[no-untyped-def]
            for v in (one, alls):
                ctx[v] = ctx[v] + ctx.replica_index

        rt.run(step)
        assert rt.get_tensor_data(one).tolist() == [[10.0], [21.0]]  # each group's first member: 0 and 1
        assert rt.get_tensor_data(alls).tolist() == [[10.0], [21.0], [12.0], [23.0]]
        assert rt.get_replica_data(alls).tolist() == [[10.0], [21.0], [12.0], [23.0]]


def test_write_variable_data() -> None:
    with Runtime(replication=4) as rt:
        rg = rt.replica_grouping(group_size=2)
        v = rt.variable(np.zeros((2, 3), np.float32), replica_grouping=rg)
        rt.write_variable_data(v, np.array([[1, 2, 3], [4, 5, 6]], np.float64))  # same-kind cast
        assert rt.run(lambda ctx: ctx[v])[:, 0].tolist() == [1, 1, 4, 4]
        with pytest.raises(ValueError, match=r"shape \(3,\).*\(2, 3\)"):
            rt.write_variable_data(v, np.zeros(3))
        with pytest.raises(TypeError, match="complex128"):
            rt.write_variable_data(v, np.zeros((2, 3), complex))


def test_host_data_needs_a_group_axis() -> None:
    with Runtime(replication=4) as rt:
        with pytest.raises(ValueError, match=r"shape \(3,\) needs a leading axis of 2"):
            rt.variable(np.zeros(3), replica_grouping=rt.replica_grouping(group_size=2))
        with pytest.raises(ValueError, match="retrieval_mode='some'"):
            rt.variable(np.zeros(3), retrieval_mode="some")


def test_each_replica_owns_its_state() -> None:
    with Runtime(replication=4) as rt:
        v = rt.variable(np.zeros(2))

        def step(ctx, x):  # type: ignore[no-untyped-def]
            before = ctx[v]
            ctx[v] = before + x
            assert before.tolist() == [0.0, 0.0]  # an earlier read is a snapshot, not a live view
            return ctx[v]

        out = rt.run(step, np.arange(4.0)[:, None] * np.ones((4, 2)))
        assert out[:, 0].tolist() == [0, 1, 2, 3]
        assert rt.get_replica_data(v)[:, 1].tolist() == [0, 1, 2, 3]


def test_reads_are_read_only_and_writes_checked() -> None:
    with Runtime(replication=2) as rt:
        v = rt.variable(np.zeros(3, np.float32), name="w")
        with pytest.raises(ValueError, match="read-only"):
            rt.run(lambda ctx: ctx[v].__iadd__(1))
        with pytest.raises(ValueError, match=r"'w'.*shape \(2,\).*\(3,\)"):
            rt.run(lambda ctx: ctx.__setitem__(v, np.zeros(2, np.float32)))
        with pytest.raises(TypeError, match=r"'w'.*float64.*float32"):
            rt.run(lambda ctx: ctx.__setitem__(v, np.zeros(3)))
        rt.run(lambda ctx: ctx.__setitem__(v, [1, 2, 3]))  # non-arrays are converted
        assert rt.get_tensor_data(v).tolist() == [1, 2, 3]


def test_names_are_unique() -> None:
    with Runtime(replication=2) as rt, Runtime(replication=2) as other:
        rt.variable(np.zeros(1), name="variable_1")
        a = rt.variable(np.zeros(1))
        b = rt.variable(np.zeros(1))
        assert len({a.name, b.name, "variable_1"}) == 3
        with pytest.raises(ValueError, match="'variable_1' already exists"):
            rt.variable(np.zeros(1), name="variable_1")
        assert rt.variables.names() == ["variable_1", a.name, b.name] and len(rt.variables) == 3
        assert rt.variables[a.name] is a
        foreign = other.variable(np.zeros(1))
        with pytest.raises(ValueError, match="not a variable of this Runtime"):
            rt.get_tensor_data(foreign)
        with pytest.raises(ValueError, match="not a variable of this Runtime"):
            rt.run(lambda ctx: ctx[foreign])


def test_host_calls_inside_a_step_are_refused() -> None:
    with Runtime(replication=2) as rt:
        v = rt.variable(np.zeros(1))
        with pytest.raises(RuntimeError, match="inside a step"):
            rt.run(lambda ctx: rt.get_tensor_data(v))


def test_comm_group_variable() -> None:
    with Runtime(replication=4) as rt:
        v = rt.variable(np.array([1.0, 2.0]), replica_grouping=CommGroup.orthogonal(2), retrieval_mode="all_replicas")
        assert rt.get_tensor_data(v).tolist() == [1.0, 2.0, 1.0, 2.0]


@pytest.mark.parametrize(
    "data, dtype, shown",
    [
        ("abc", None, "<U3 (str)"),
        (["a", "bc"], None, "<U2 (str)"),
        (b"abc", None, "|S3 (bytes)"),
        ([1, "a", None], None, "object (object)"),
        (np.array(["2024-01-01"], dtype="datetime64[D]"), None, "datetime64[D] (datetime)"),
        ([1.0, 2.0], str, "<U0 (str)"),
    ],
)
def test_non_numeric_dtypes_are_refused_in_one_line(data: object, dtype: object, shown: str) -> None:
    with Runtime(replication=2) as rt:
        with pytest.raises(TypeError) as info:
            rt.variable(data, dtype=dtype, name="x")
        assert str(info.value) == f"variable 'x': dtype {shown} is not supported (use a numeric or bool dtype)"
        assert rt.variable(np.array([True, False])).dtype == np.bool_  # bool stays accepted
