"""The canonical reduction tree: shape, decomposition into pieces, programs over any split, op names."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from popdist_py.engine._collectives.reduce import (
    OPS,
    Node,
    Program,
    check_operands,
    decompose,
    reduce_sequence,
    reduction_op,
    split,
)

pytestmark = pytest.mark.one_executor  # no Runtime here


def run(node: Node, known: dict[Node, np.ndarray], ufunc: np.ufunc, out: np.ndarray | None = None) -> np.ndarray:
    """The value of ``node`` from ``known`` (nodes covering it), as the engine computes it: a Program."""
    nodes = sorted(known)
    target = np.empty_like(known[nodes[0]]) if out is None else out
    return Program(node, nodes).run([known[k] for k in nodes], ufunc, target)


def tree(values: list[np.ndarray], lo: int = 0, hi: int | None = None) -> np.ndarray:
    """Independent statement of the order: split at the largest power of two below the count."""
    hi = len(values) if hi is None else hi
    n = hi - lo
    if n == 1:
        return values[lo]
    p = 1
    while p * 2 < n:
        p *= 2
    total: np.ndarray = tree(values, lo, lo + p) + tree(values, lo + p, hi)
    return total


def test_split_points() -> None:
    assert [split(0, n) for n in range(2, 10)] == [1, 2, 2, 4, 4, 4, 4, 8]
    assert split(4, 6) == 5 and split(8, 16) == 12


def test_six_members_shape() -> None:
    v = [np.array([float(i)]) for i in range(6)]
    calls: list[tuple[float, float]] = []

    def add(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
        calls.append((a[0], b[0]))
        summed: np.ndarray = np.add(a, b, out=out)
        return summed

    class U:  # stands in for a ufunc to record the order of operations
        def __call__(self, a, b, out):  # type: ignore[no-untyped-def]
            return add(a, b, out)

    run((0, 6), {(k, k + 1): v[k] for k in range(6)}, U())  # type: ignore[arg-type]
    assert calls == [(0, 1), (2, 3), (1, 5), (4, 5), (6, 9)]


@pytest.mark.parametrize("size", range(1, 17))
def test_decompose_covers_exactly_with_tree_nodes(size: int) -> None:
    def nodes(lo: int, hi: int) -> set[tuple[int, int]]:
        out = {(lo, hi)}
        if hi - lo > 1:
            mid = split(lo, hi)
            out |= nodes(lo, mid) | nodes(mid, hi)
        return out

    all_nodes = nodes(0, size)
    for a in range(size):
        for b in range(a + 1, size + 1):
            pieces = decompose(a, b, size)
            assert all(p in all_nodes for p in pieces)
            covered = [k for lo, hi in pieces for k in range(lo, hi)]
            assert covered == list(range(a, b))
            # maximal: no two neighbouring pieces form a node together
            for (l1, h1), (_, h2) in itertools.pairwise(pieces):
                assert (l1, h2) not in all_nodes or split(l1, h2) != h1


def wild(rng: np.random.Generator, n: int, size: int) -> list[np.ndarray]:
    """float32 values over many magnitudes, so that the order of additions changes the result."""
    return [(rng.standard_normal(size) * 10.0 ** rng.integers(-4, 5, size)).astype(np.float32) for _ in range(n)]


@pytest.mark.determinism
@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 12), seed=st.integers(0, 2**31), data=st.data())
def test_any_split_gives_the_same_bits(size: int, seed: int, data: st.DataObject) -> None:
    rng = np.random.default_rng(seed)
    values = wild(rng, size, 33)
    expect = tree(values)
    assert np.array_equal(reduce_sequence(values), expect)
    # cut the members into contiguous runs (one per "instance"), reduce each run's pieces locally
    cuts = sorted(data.draw(st.sets(st.integers(1, max(size - 1, 1)), max_size=size - 1)) if size > 1 else set())
    bounds = [0, *cuts, size]
    known = {}
    for a, b in itertools.pairwise(bounds):
        leaves = {(k, k + 1): values[k] for k in range(a, b)}
        for node in decompose(a, b, size):
            known[node] = run(node, leaves, np.add)
    got = run((0, size), known, np.add, out=np.empty(33, np.float32))
    assert got.tobytes() == expect.tobytes()


def test_order_matters_for_these_inputs() -> None:
    """Guard against a vacuous determinism test: a left-to-right sum gives other bits."""
    rng = np.random.default_rng(1)
    values = wild(rng, 6, 1000)
    seq = values[0].copy()
    for v in values[1:]:
        seq = seq + v
    assert not np.array_equal(seq, tree(values))


def test_ops_and_mean() -> None:
    v = [np.array([1.0, 4.0]), np.array([3.0, 2.0]), np.array([5.0, -1.0])]
    assert reduce_sequence(v, "max").tolist() == [5.0, 4.0]
    assert reduce_sequence(v, "min").tolist() == [1.0, -1.0]
    assert reduce_sequence(v, "mul").tolist() == [15.0, -8.0]
    assert reduce_sequence(v, "mean").tolist() == [3.0, 5.0 / 3.0]


def test_programs_do_not_write_their_inputs() -> None:
    v = [np.arange(4.0) + k for k in range(5)]
    before = [a.copy() for a in v]
    run((0, 5), {(k, k + 1): v[k] for k in range(5)}, np.add)
    assert all(np.array_equal(a, b) for a, b in zip(v, before, strict=True))


@pytest.mark.determinism
def test_blocked_runs_give_the_same_bits() -> None:
    rng = np.random.default_rng(3)
    values = wild(rng, 5, 1000)
    prog = Program((0, 5), [(k, k + 1) for k in range(5)])
    whole = prog.run(values, np.add, np.empty(1000, np.float32))
    blocked = prog.run_blocked(values, np.add, np.empty(1000, np.float32), divide_by=5, block=64)
    assert blocked.tobytes() == (whole / np.float32(5)).tobytes()


@pytest.mark.parametrize("alias, name", [("sum", "add"), ("prod", "mul")])
def test_host_collective_op_names_are_accepted(alias: str, name: str) -> None:
    assert reduction_op(alias) == name and reduction_op(name) == name
    v = [np.array([1.0, 4.0]), np.array([3.0, 2.0]), np.array([5.0, -1.0])]
    assert reduce_sequence(v, alias).tolist() == reduce_sequence(v, name).tolist()


@pytest.mark.parametrize("bad", ["avg", "SUM", "", None, 1])
def test_unknown_ops_name_the_valid_ones(bad: object) -> None:
    with pytest.raises(ValueError, match=r"collective: op=.* is not supported; use one of add, mean, mul, min, max "
                                         r"\(or sum for add, prod for mul\)"):
        reduction_op(bad, "collective")
    assert set(OPS) == {"add", "mean", "mul", "min", "max"}


def test_a_block_at_most_one_block_long_runs_whole() -> None:
    rng = np.random.default_rng(4)
    values = wild(rng, 5, 100)
    prog = Program((0, 5), [(k, k + 1) for k in range(5)])
    whole = prog.run(values, np.add, np.empty(100, np.float32))
    assert prog.run_blocked(values, np.add, np.empty(100, np.float32)).tobytes() == whole.tobytes()
    mean = prog.run_blocked(values, np.add, np.empty(100, np.float32), divide_by=5, block=100)
    assert mean.tobytes() == (whole / np.float32(5)).tobytes()


def test_square_add_squares_every_member_even_alone() -> None:
    assert reduce_sequence([np.array([3.0, -2.0]), np.array([4.0, 1.0])], "square_add").tolist() == [25.0, 5.0]
    assert reduce_sequence([np.array([-3.0])], "square_add").tolist() == [9.0]


def test_reduce_sequence_returns_a_copy_and_names_itself() -> None:
    only = np.array([1.0, 2.0])
    out = reduce_sequence([only])
    assert out.tolist() == [1.0, 2.0] and not np.shares_memory(out, only)
    with pytest.raises(ValueError, match=r"^nothing to reduce$"):
        reduce_sequence([])
    with pytest.raises(ValueError, match=r"^reduce_sequence: op='avg' is not supported"):
        reduce_sequence([only], "avg")
    with pytest.raises(ValueError, match=r"^reduction: op='avg' is not supported; .*, square_add \(the sum of "
                                         r"squares\), or on bool inputs and or or$"):
        reduction_op("avg")


def test_operands_each_op_takes_and_refuses() -> None:
    for op, good, bad in [("mean", "float32", "int32"), ("mean", "complex64", "bool"), ("and", "bool", "int8"),
                          ("or", "bool", "float32"), ("square_add", "int8", "bool"),
                          ("square_add", "uint8", "complex64"), ("square_add", "float64", "bool")]:
        check_operands(op, np.dtype(good), "x")
        with pytest.raises(TypeError, match=rf"^x: op='{op}' .*, got dtype {bad}"):
            check_operands(op, np.dtype(bad), "x")
    for op in ("add", "max"):
        check_operands(op, np.dtype("int32"), "x")  # no rule of mean, logical or square_add applies
    with pytest.raises(TypeError, match=r"^x: op='mean' needs a floating-point input, got dtype int32$"):
        check_operands("mean", np.dtype("int32"), "x")
    with pytest.raises(TypeError, match=r"^x: op='or' is logical and takes bool inputs only \(as PopXL's\), "
                                        r"got dtype int8; compare first, e\.g\. x != 0$"):
        check_operands("or", np.dtype("int8"), "x")
    square_add = r"^x: op='square_add' needs an integer or floating-point input, got dtype bool$"
    with pytest.raises(TypeError, match=square_add):
        check_operands("square_add", np.dtype("bool"), "x")


def test_programs_compile_to_these_slots() -> None:
    """The compiled form: the output is written first, an owned temporary is reused (9 below)."""
    def members(n: int) -> Program:
        return Program((0, n), [(k, k + 1) for k in range(n)])

    two = members(2)
    assert (two.ops, two.ntemp, two.pair, two.result) == (((0, 1, -1),), 0, (0, 1), -1)
    assert (members(4).ops, members(4).ntemp, members(4).pair) == (((0, 1, -1), (2, 3, 4), (-1, 4, -1)), 1, None)
    eight = members(8)
    assert eight.ops == ((0, 1, -1), (2, 3, 8), (-1, 8, -1), (4, 5, 9), (6, 7, 10), (9, 10, 9), (-1, 9, -1))
    assert eight.ntemp == 3
    right_owned = Program((0, 8), [(0, 4), (4, 6), (6, 7), (7, 8)])  # (4, 8) reuses its right part's temporary
    assert (right_owned.ops, right_owned.ntemp) == (((2, 3, 4), (1, 4, 4), (0, 4, -1)), 1)
    for covered, missing in [([(0, 1), (1, 2), (2, 3)], 3), ([(1, 2), (2, 3), (3, 4)], 0)]:
        with pytest.raises(KeyError, match=f"member {missing} of the reduction is missing"):
            Program((0, 4), covered)


def test_programs_use_the_scratch_they_are_given() -> None:
    rng = np.random.default_rng(5)
    values = [v.reshape(2, 50) for v in wild(rng, 8, 100)]
    prog = Program((0, 8), [(k, k + 1) for k in range(8)])
    fresh = prog.run(values, np.add, np.empty((2, 50), np.float32))
    scratch = [np.full(128, np.nan, np.float32) for _ in range(prog.ntemp)]
    reused = prog.run(values, np.add, np.empty((2, 50), np.float32), temps=scratch)
    assert reused.tobytes() == fresh.tobytes()
    assert not np.isnan(scratch[0][:100]).any() and np.isnan(scratch[0][100:]).all()


def test_integer_blocked_runs_are_not_divided() -> None:
    values = [np.arange(300, dtype=np.int32) * (k + 1) for k in range(5)]
    prog = Program((0, 5), [(k, k + 1) for k in range(5)])
    for block in (64, 4096):
        got = prog.run_blocked(values, np.add, np.empty(300, np.int32), block=block)
        assert got.tolist() == (np.arange(300) * 15).tolist()


@pytest.mark.determinism
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_pieces_are_reduced_in_their_own_dtype(dtype: str) -> None:
    """Inputs in pieces, cut alike and differently, give the bits of the packed arrays (scratch or
    temporaries of another dtype, e.g. float64 for int32, would not even run)."""
    from popdist_py.engine._collectives.segments import Segments

    rng = np.random.default_rng(6)
    packed = wild(rng, 5, 1000) if dtype == "float32" else [rng.integers(-1000, 1000, 1000, np.int32) for _ in range(5)]
    prog = Program((0, 5), [(k, k + 1) for k in range(5)])
    expect = prog.run_blocked(packed, np.add, np.empty(1000, dtype), block=64)
    alike = [Segments(np.array_split(p, 7), np.dtype(dtype)) for p in packed]
    cut_differently = [Segments(np.array_split(p, 3 + k), np.dtype(dtype)) for k, p in enumerate(packed)]
    for inputs in (alike, cut_differently):
        got = prog.run_blocked(inputs, np.add, np.empty(1000, dtype), block=64)
        assert got.tobytes() == expect.tobytes()


def test_empty_pieces_reduce_to_nothing() -> None:
    from popdist_py.engine._collectives.segments import Segments

    for n in (2, 5):
        prog = Program((0, n), [(k, k + 1) for k in range(n)])
        for pieces in ([], [np.zeros(0, np.float32)]):
            got = prog.run_blocked([Segments(list(pieces), np.float32) for _ in range(n)], np.add,
                                   np.empty(0, np.float32), divide_by=n)
            assert got.shape == (0,) and got.dtype == np.float32
