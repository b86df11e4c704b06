"""Host collectives and execute_on_instances on real MPI ranks (instance i = rank i).

``timeout 120 .venv/bin/mpiexec -n 2 .venv/bin/python -m pytest -q --with-mpi tests/mpi/test_collectives.py``
(and ``-n 3``). Each rank's data is derived from its rank, so every rank can compute the expected
result of the others.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import popdist_py
from popcontract.environment import COLLECTIVE_TIMEOUT
from popdist_py.errors import CollectiveMismatchError
from popdist_py.world import world

DTYPES = ["int8", "int32", "int64", "uint8", "uint64", "float16", "float32", "float64", "complex64", "complex128"]


@pytest.fixture(autouse=True)
def _short_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COLLECTIVE_TIMEOUT, "30")


def rank_size() -> tuple[int, int]:
    return world().Get_rank(), world().Get_size()


def data(rank: int, dtype: str, shape: tuple[int, ...] = (2, 3)) -> np.ndarray:
    return (np.arange(int(np.prod(shape))).reshape(shape) % 5 + 1 + rank).astype(dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "mean", "min", "max", "prod"])
def test_allreduce_ops_and_dtypes(op: str, dtype: str) -> None:
    rank, n = rank_size()
    if op in ("min", "max") and dtype.startswith("complex"):
        with pytest.raises(TypeError, match=f"op='{op}' is not defined for complex arrays"):
            popdist_py.allreduce(data(rank, dtype), op=op)
        return
    mine = data(rank, dtype)
    before = mine.copy()
    out = popdist_py.allreduce(mine, op=op)
    assert np.array_equal(mine, before), "the input was modified"
    assert out.dtype == np.dtype(dtype) and out.shape == mine.shape
    wide = "complex128" if dtype.startswith("complex") else ("float64" if dtype.startswith("float") else "int64")
    stack = np.stack([data(r, dtype).astype(wide) for r in range(n)])
    if op == "mean":
        expected = stack.sum(0) // n if np.dtype(dtype).kind in "iu" else stack.sum(0) / n
    else:
        reductions: dict[str, Callable[..., Any]] = {"sum": np.sum, "min": np.min, "max": np.max, "prod": np.prod}
        expected = reductions[op](stack, axis=0)
    expected = expected.astype(dtype)
    if np.dtype(dtype).kind in "iu":
        assert np.array_equal(out, expected)
    else:
        np.testing.assert_allclose(out, expected, rtol=1e-3 if dtype == "float16" else 1e-6)


@pytest.mark.mpi(min_size=2)
def test_engine_spellings_add_and_mul_are_sum_and_prod() -> None:
    rank, n = rank_size()
    x = np.array([rank + 1, 2], dtype=np.int64)
    total, product = [n * (n + 1) // 2, 2 * n], [math.factorial(n), 2**n]
    assert popdist_py.allreduce(x, op="add").tolist() == total
    assert popdist_py.allreduce(x, op="mul").tolist() == product
    assert popdist_py.allreduce(x.astype(np.float32), op="Add").tolist() == total
    # One collective however each instance spells it: the op is normalised before the agreement.
    assert popdist_py.allreduce(x, op="add" if rank % 2 else "sum").tolist() == total
    assert popdist_py.allreduce(x, op="prod" if rank % 2 else "mul").tolist() == product
    # Messages use the host collectives' names.
    with pytest.raises(CollectiveMismatchError, match=("allreduce: ops differ between instances: "
                                                       "instance 0 sum, instance 1 prod")):
        popdist_py.allreduce(x, op="add" if rank == 0 else "mul")


@pytest.mark.mpi(min_size=2)
def test_integer_mean_is_the_floor_of_the_exact_mean() -> None:
    rank, n = rank_size()
    out = popdist_py.allreduce(np.array([rank, -rank, 1 if rank == 0 else 0], dtype=np.int32), op="mean")
    total = sum(range(n))
    assert out.tolist() == [total // n, -total // n, 1 // n]
    assert out.dtype == np.int32


@pytest.mark.mpi(min_size=2)
def test_bool_min_max_are_logical_and_or() -> None:
    rank, _n = rank_size()
    x = np.array([True, rank == 0, False])
    assert popdist_py.allreduce(x, op="min").tolist() == [True, False, False]
    assert popdist_py.allreduce(x, op="max").tolist() == [True, True, False]
    with pytest.raises(TypeError, match="op='sum' is not defined for bool arrays"):
        popdist_py.allreduce(x)


@pytest.mark.mpi(min_size=2)
def test_noncontiguous_big_endian_0d_and_empty_inputs() -> None:
    rank, n = rank_size()
    base = np.arange(24, dtype=np.float64).reshape(4, 6) * (rank + 1)
    view = base[::2, ::3]
    assert not view.flags.c_contiguous
    out = popdist_py.allreduce(view)
    assert np.array_equal(out, np.arange(24.0).reshape(4, 6)[::2, ::3] * sum(range(1, n + 1)))
    assert np.array_equal(base, np.arange(24, dtype=np.float64).reshape(4, 6) * (rank + 1))
    big = (np.array([1, 2]) * (rank + 1)).astype(">i4")
    assert big.dtype == np.dtype(">i4")
    out = popdist_py.allreduce(big, op="max")
    assert out.dtype == np.dtype(">i4") and out.tolist() == [n, 2 * n]
    scalar = popdist_py.allreduce(np.float32(rank))
    assert scalar.shape == () and scalar == sum(range(n))
    empty = popdist_py.allreduce(np.zeros((0, 3), dtype=np.float32))
    assert empty.shape == (0, 3)
    assert popdist_py.allgather(np.zeros((2, 0))).shape == (n, 2, 0)


@pytest.mark.mpi(min_size=2)
def test_allgather_has_a_leading_instance_axis() -> None:
    rank, n = rank_size()
    mine = data(rank, "float32", (3, 2)).T  # non-contiguous
    out = popdist_py.allgather(mine)
    assert out.shape == (n, 2, 3) and out.dtype == np.float32
    for r in range(n):
        assert np.array_equal(out[r], data(r, "float32", (3, 2)).T)
    record = np.zeros(2, dtype=[("id", "i4"), ("score", "f8")])
    record["id"] = rank
    out = popdist_py.allgather(record)
    assert out["id"].tolist() == [[r, r] for r in range(n)]
    flags = popdist_py.allgather(np.array(rank % 2 == 0))
    assert flags.tolist() == [r % 2 == 0 for r in range(n)]


@pytest.mark.mpi(min_size=2)
def test_broadcast_from_every_root() -> None:
    rank, n = rank_size()
    for root in range(n):
        mine = np.full((2, 2), rank, dtype=np.float16)
        out = popdist_py.broadcast(mine, root=root)
        assert out.dtype == np.float16 and (out == root).all()
        assert (mine == rank).all()
        assert out is not mine
    assert popdist_py.broadcast(np.array(["a", "bc"]) if rank == 0 else np.array(["zz", "zz"])).tolist() == ["a", "bc"]


@pytest.mark.mpi(min_size=2)
def test_barrier_and_synchronize() -> None:
    # Each call must hold every instance until all have arrived: rank 0 arrives late and writes
    # its mark just before it arrives, so an instance let through early would not find that mark.
    rank, n = rank_size()
    shared = world().bcast(tempfile.mkdtemp(prefix="barrier-") if rank == 0 else None, root=0)
    for step, wait in enumerate([popdist_py.barrier, popdist_py.synchronize, lambda: popdist_py.barrier(timeout=10)]):
        if rank == 0:
            time.sleep(0.3)  # not a timing check: it only makes a barrier that does not wait visible
        open(os.path.join(shared, f"{step}.{rank}"), "w").close()
        wait()
        seen = {name for name in os.listdir(shared) if name.startswith(f"{step}.")}
        assert seen == {f"{step}.{r}" for r in range(n)}, f"step {step}: passed having seen only {sorted(seen)}"
    world().Barrier()  # every rank has looked before rank 0 removes the marks
    if rank == 0:
        for name in os.listdir(shared):
            os.remove(os.path.join(shared, name))
        os.rmdir(shared)


@pytest.mark.mpi(min_size=2)
def test_mismatches_are_named_on_every_instance() -> None:
    rank, n = rank_size()
    others = ", ".join(f"instance {r} (4,)" for r in range(1, n))
    with pytest.raises(CollectiveMismatchError) as info:
        popdist_py.allreduce(np.zeros((3, 4) if rank == 0 else (4,), dtype=np.float32))
    assert str(info.value) == f"allreduce: shapes differ between instances: instance 0 (3, 4), {others}"
    with pytest.raises(CollectiveMismatchError, match=("allreduce: dtypes differ between instances: "
                                                       "instance 0 float32, instance 1 float64")):
        popdist_py.allreduce(np.zeros(2, dtype=np.float32 if rank == 0 else np.float64))
    with pytest.raises(CollectiveMismatchError, match=("allreduce: ops differ between instances: "
                                                       "instance 0 sum, instance 1 max")):
        popdist_py.allreduce(np.zeros(2), op="sum" if rank == 0 else "max")
    with pytest.raises(CollectiveMismatchError, match=("broadcast: roots differ between instances: "
                                                       "instance 0 0, instance 1 1")):
        popdist_py.broadcast(np.zeros(2), root=min(rank, 1))
    with pytest.raises(CollectiveMismatchError, match=(r"allgather: shapes differ between instances: "
                                                       r"instance 0 \(2,\), instance 1 \(3,\)")):
        popdist_py.allgather(np.zeros(2 if rank == 0 else 3))
    with pytest.raises(CollectiveMismatchError, match=("instances are in different collectives: "
                                                       "instance 0 allgather, instance 1 broadcast")):
        if rank == 0:
            popdist_py.allgather(np.zeros(2))
        else:
            popdist_py.broadcast(np.zeros(2))
    assert popdist_py.allreduce(np.ones(1))[0] == n  # everything still works after the errors


@pytest.mark.mpi(min_size=2)
def test_bad_arguments_are_rejected_before_any_communication() -> None:
    _rank, n = rank_size()
    with pytest.raises(ValueError, match=r"op='avg' is not valid: valid ops are sum, mean, min, max, prod \(or "
                                         r"add for sum, mul for prod\)"):
        popdist_py.allreduce(np.ones(2), op="avg")
    with pytest.raises(ValueError, match=f"root={n} is not a valid instance: valid instances are 0..{n - 1}"):
        popdist_py.broadcast(np.ones(2), root=n)
    with pytest.raises(TypeError, match="broadcast: root must be an integer, got True of type bool"):
        popdist_py.broadcast(np.ones(2), root=True)
    with pytest.raises(TypeError, match=r"allgather: expected a numpy array, got list \[1, 2\]"):
        popdist_py.allgather([1, 2])
    with pytest.raises(TypeError, match="dtype object"):
        popdist_py.allgather(np.array([None]))
    with pytest.raises(TypeError, match="cannot reduce arrays of dtype <U1"):
        popdist_py.allreduce(np.array(["a"]))
    with pytest.raises(ValueError, match="timeout=-1 must be a positive number"):
        popdist_py.barrier(timeout=-1)


@pytest.mark.mpi(min_size=2)
def test_execute_on_one_instance() -> None:
    rank, n = rank_size()
    calls: list[float] = []

    def f(x: float, *, scale: int) -> float:
        calls.append(x)
        total = popdist_py.allreduce(np.array([x * scale]))  # only instance 0 takes part
        popdist_py.synchronize()
        return float(total[0])

    result = popdist_py.execute_on_instances({0}, f, 2.0, scale=3)
    assert result == (6.0 if rank == 0 else None)
    assert calls == ([2.0] if rank == 0 else [])
    assert popdist_py.execute_on_instances(range(n), lambda: popdist_py.allreduce(np.ones(1))[0]) == n
    assert popdist_py.execute_on_instances(n - 1, lambda: "last") == ("last" if rank == n - 1 else None)
    assert popdist_py.execute_on_instances(set(), lambda: "never") is None


@pytest.mark.mpi(min_size=2)
def test_execute_on_instances_rejects_bad_indices() -> None:
    rank, n = rank_size()
    with pytest.raises(ValueError, match=rf"invalid instance indices \[-1, {n}\]: valid instances are 0..{n - 1}"):
        popdist_py.execute_on_instances({0, n, -1}, print)
    with pytest.raises(TypeError, match="instance indices must be integers"):
        popdist_py.execute_on_instances({"0"}, print)
    with pytest.raises(TypeError, match="must be a set of instance indices"):
        popdist_py.execute_on_instances("01", print)

    def inner() -> None:
        popdist_py.execute_on_instances({1}, print)

    if rank == 0:
        with pytest.raises(ValueError, match=r"invalid instance indices \[1\]: only instances 0 run the enclosing"):
            popdist_py.execute_on_instances({0}, inner)
    else:  # every instance takes part in the agreement on the set {0}
        assert popdist_py.execute_on_instances({0}, inner) is None


@pytest.mark.mpi(min_size=3)
def test_different_instance_sets_are_a_mismatch_on_every_instance() -> None:
    """Instance 1 is in instance 2's set but not in its own: it must say so, not leave 2 waiting."""
    rank, n = rank_size()
    wanted = {0, 1, 2} if rank == 2 else {0, 2}
    others = ", ".join(f"instance {i} (0, 2)" for i in range(3, n))
    expected = ("execute_on_instances: instance sets differ between instances: instance 0 (0, 2), "
                "instance 1 (0, 2), instance 2 (0, 1, 2)" + (f", {others}" if others else ""))
    calls: list[int] = []
    with pytest.raises(CollectiveMismatchError) as info:
        popdist_py.execute_on_instances(wanted, calls.append, rank)
    assert str(info.value) == expected
    assert calls == []
    # The world communicator (and its check communicator) is still usable, also for subsets.
    assert popdist_py.allreduce(np.ones(1))[0] == n
    assert popdist_py.execute_on_instances({0, 2}, lambda: int(popdist_py.allreduce(np.ones(1))[0])) == (
        2 if rank in (0, 2) else None)


@pytest.mark.mpi(min_size=3)
def test_execute_on_a_subset_of_three() -> None:
    rank, n = rank_size()

    def on_subset() -> tuple[int, list[int], int, list[int] | None]:
        total = popdist_py.allreduce(np.array([rank], dtype=np.int64))
        gathered = popdist_py.allgather(np.array(rank))
        root2 = popdist_py.broadcast(np.array([rank]), root=2)
        with pytest.raises(ValueError, match="root=1 is not a valid instance: valid instances are 0, 2"):
            popdist_py.broadcast(np.array([rank]), root=1)
        nested = popdist_py.execute_on_instances({2}, lambda: popdist_py.allgather(np.array(rank)).tolist())
        with pytest.raises(CollectiveMismatchError, match=(r"allreduce: shapes differ between instances: "
                                                           r"instance 0 \(1,\), instance 2 \(2,\)")):
            popdist_py.allreduce(np.zeros(1 if rank == 0 else 2))
        popdist_py.synchronize()
        return int(total[0]), gathered.tolist(), int(root2[0]), nested

    for _ in range(2):  # the second call reuses the sub-communicator
        result = popdist_py.execute_on_instances({2, 0}, on_subset)
        if rank in (0, 2):
            assert result == (2, [0, 2], 2, [2] if rank == 2 else None)
        else:
            assert result is None
    assert popdist_py.allreduce(np.ones(1))[0] == n  # the world is untouched
