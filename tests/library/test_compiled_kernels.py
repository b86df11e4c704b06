"""The compiled kernels refuse what they cannot handle, and nothing crashes.

Every entry point of every compiled part (``_batch_invariant``'s matmul and outer_sum, the
reduction kernel ``_tree.add_tree``, ``_swaps.swap_pass``, ``_subreaper.become``) checks its
arguments' dtypes, shapes, strides, alignment, writability and the sizes they imply before it
allocates, and refuses with an exception naming the argument. Properties over dtypes (wrong ones
too), shapes (empty, one, huge), strides (negative, zero, non-contiguous), misaligned and
read-only buffers; every accepted result is compared with the numpy reference. The crashes that
were found first run in a subprocess, so that one fails its test rather than the run.
`make sanitize` runs this file under AddressSanitizer and UndefinedBehaviorSanitizer.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from popdist_py import _swaps
from popdist_py.data import swap_pass_in_python
from popdist_py.engine import _batch_invariant as kernels
from popdist_py.engine import canonical_sum
from popdist_py.engine._collectives import reduce
from popdist_py.engine._collectives._tree import add_tree
from popdist_py.engine._collectives.reduce import Program
from popdist_py.engine.batch_invariant import KC, matmul, outer_sum
from poprun_py.shared import _subreaper
from tests.helpers import run

#: Bounded: these properties together take a few seconds.
BOUNDED = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FLOATS = [np.dtype(np.float32), np.dtype(np.float64)]
#: dtypes the kernels refuse (or decline): other kinds, sizes and byte orders
WRONG_DTYPES = [np.dtype(t) for t in (np.float16, np.int32, np.int64, np.uint8, np.complex64, np.bool_, ">f4", ">f8")]
LAYOUTS = ["contiguous", "fortran", "reversed", "strided", "broadcast", "misaligned", "readonly"]


def laid_out(values: np.ndarray, layout: str) -> np.ndarray:
    """An array of ``values`` (for "broadcast": of its first row, repeated) in ``layout``: how it
    lies in memory, not what it holds."""
    if layout == "contiguous":
        return values.copy()
    if layout == "fortran":
        return np.asfortranarray(values)
    if layout == "reversed":  # negative strides on every axis
        flipped = values[(slice(None, None, -1),) * values.ndim].copy()
        return flipped[(slice(None, None, -1),) * values.ndim]
    if layout == "strided":  # every other item of a larger array
        big = np.zeros(tuple(2 * s for s in values.shape), values.dtype)
        view = big[(slice(None, None, 2),) * values.ndim]
        view[...] = values
        return view
    if layout == "broadcast":  # stride 0 along the first axis
        return np.broadcast_to(values[:1], values.shape) if len(values) else values.copy()
    if layout == "misaligned":  # at an odd byte offset of a byte buffer
        raw = np.zeros(values.nbytes + values.itemsize, np.uint8)
        view = raw[1:1 + values.nbytes].view(values.dtype).reshape(values.shape)
        view[...] = values
        assert view.size == 0 or not view.flags.aligned
        return view
    assert layout == "readonly", layout
    frozen = values.copy()
    frozen.flags.writeable = False
    return frozen


def values_of(draw: st.DrawFn, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    return rng.standard_normal(shape).astype(dtype)


def refused(call: Callable[[], object], exc: type[BaseException] | tuple[type[BaseException], ...],
            *names: str) -> str:
    """The message of the exception ``call`` raises, which must be ``exc``, one line, naming each of ``names``."""
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and all(name in message for name in names), message
    return message


# -- the crashes found first, each in a process of its own ---------------------------------------

def run_python(code: str) -> str:
    """``code`` run by this Python in a new process: its stdout, after it exited 0 (a crash fails here)."""
    done = run([sys.executable, "-c", textwrap.dedent(code)], timeout=60)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


@pytest.mark.slow  # starts Python
def test_outer_sum_refuses_a_broadcast_x_whose_packed_copy_cannot_be_addressed() -> None:
    """A stride-0 x of 2**60 rows is a view of one row; its packed copy, 2**65 bytes, overflowed
    the size computed for it: the kernel allocated a few bytes and wrote past them."""
    out = run_python("""
        import numpy as np
        from popdist_py.engine.batch_invariant import outer_sum
        x = np.broadcast_to(np.ones((1, 1), np.float32), (2**60, 1))
        try:
            outer_sum(x, np.zeros((2**60, 0), np.float32))
        except MemoryError as exc:
            print("refused:", exc)
    """)
    assert "refused: outer_sum: x has 1152921504606846976 rows of 1: its packed copy would not fit" in out, out


@pytest.mark.slow  # starts Python
def test_outer_sum_of_an_empty_result_allocates_nothing() -> None:
    """2**45 broadcast rows into an empty out: numpy's result at once, no 2**50-byte packed copy."""
    out = run_python("""
        import numpy as np
        from popdist_py.engine.batch_invariant import outer_sum
        x = np.broadcast_to(np.ones((1, 8), np.float32), (2**45, 8))
        got = outer_sum(x, np.zeros((2**45, 0), np.float32))
        print("shape:", got.shape, got.dtype, (x.T @ np.zeros((2**45, 0), np.float32)).shape)
    """)
    assert "shape: (8, 0) float32 (8, 0)" in out, out


@pytest.mark.slow  # starts Python
def test_the_reduction_kernel_refuses_a_huge_temporary_count() -> None:
    """ntemp 2**51: its scratch of ntemp x 2048 floats overflowed to an allocation of 0 bytes,
    which the program's first temporary then wrote past (a corrupted heap)."""
    out = run_python("""
        import numpy as np
        from popdist_py.engine._collectives._tree import add_tree
        x = [np.ones(5000, np.float32) for _ in range(3)]
        out = np.zeros(5000, np.float32)
        try:
            add_tree(x, ((0, 1, 3), (3, 2, -1)), 2**51, -1, out, 0)
        except ValueError as exc:
            print("refused:", exc, "written:", bool(out.any()))
    """)
    said = "refused: add_tree: ntemp is 2251799813685248; a program of 2 ops writes 0 to 2 temporaries written: False"
    assert said in out, out


# -- matmul and outer_sum ----------------------------------------------------------------------

@st.composite
def product_operands(draw: st.DrawFn, outer: bool) -> tuple[np.ndarray, np.ndarray]:
    """Operands of matmul (x [M, K], w [K, N]) or outer_sum (x [B, K], y [B, N]) in any layout."""
    dtype: np.dtype[Any] = draw(st.sampled_from(FLOATS))
    m = draw(st.sampled_from([0, 1, 2, 3, 7, 8, 9, 17]) if not outer else st.sampled_from([1, 2, 3, 7, 8, 9, 17, 33]))
    k = draw(st.sampled_from([0, 1, 2, 5, 8, 9, 31, KC + 3]))
    n = draw(st.sampled_from([0, 1, 2, 5, 17, 33, 70]))
    x = laid_out(values_of(draw, (m, k), dtype), draw(st.sampled_from(LAYOUTS), label="x layout"))
    other = (m, n) if outer else (k, n)
    y = laid_out(values_of(draw, other, dtype), draw(st.sampled_from(LAYOUTS), label="y layout"))
    return x, y


@BOUNDED
@given(product_operands(outer=False))
def test_matmul_of_any_layout_is_its_contiguous_result(operands: tuple[np.ndarray, np.ndarray]) -> None:
    """Broadcast, negative, strided, Fortran, misaligned or read-only operands: the bits of the same
    values laid out plainly (the contract's result depends on values only), close to numpy's."""
    x, w = operands
    got = matmul(x, w)
    plain = matmul(np.array(x), np.array(w))
    assert got.shape == plain.shape == (x.shape[0], w.shape[1]) and got.dtype == x.dtype
    assert got.tobytes() == plain.tobytes()
    assert np.allclose(got, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-4, atol=1e-4)


@BOUNDED
@given(product_operands(outer=True))
def test_outer_sum_of_any_layout_is_the_canonical_tree(operands: tuple[np.ndarray, np.ndarray]) -> None:
    """Any layout of x and y: bitwise numpy's products summed in canonical_sum's tree."""
    x, y = operands
    want = canonical_sum(np.array(x)[:, :, None] * np.array(y)[:, None, :])
    got = outer_sum(x, y)
    assert got.shape == want.shape and got.tobytes() == want.tobytes()


@BOUNDED
@given(kind=st.sampled_from(["matmul", "outer_sum"]), dtype=st.sampled_from(WRONG_DTYPES + FLOATS),
       other=st.sampled_from(WRONG_DTYPES + FLOATS))
def test_products_of_other_dtypes_are_refused_naming_them(kind: str, dtype: np.dtype[Any],
                                                          other: np.dtype[Any]) -> None:
    assume(not (dtype == other and dtype in FLOATS))
    a, b = np.ones((3, 4), dtype), np.ones((4 if kind == "matmul" else 3, 2), other)
    call = matmul if kind == "matmul" else outer_sum
    refused(lambda: call(a, b), TypeError, f"{kind}: operands must both be float32 or both float64",
            f"got {dtype} and {other}")


HUGE = [2**40, 2**45, 2**55, 2**59, 2**60]


@BOUNDED
@given(rows=st.sampled_from(HUGE), k=st.sampled_from([0, 1, 2, 8, 9]), n=st.sampled_from([0, 1, 3]),
       dtype=st.sampled_from(FLOATS))
def test_huge_broadcast_operands_are_refused_cheaply_or_computed_when_empty(rows: int, k: int, n: int,
                                                                            dtype: np.dtype[Any]) -> None:
    """A stride-0 x of up to 2**60 rows: numpy's (empty) result when there is nothing to compute,
    else a MemoryError before anything the size of the rows is allocated (never a crash)."""
    try:
        x = np.broadcast_to(np.ones((1, k), dtype), (rows, k))
        y = np.broadcast_to(np.ones((1, n), dtype), (rows, n))
    except ValueError:  # more bytes than numpy lets an array view
        assume(False)
    # matmul: the rows are the output's, which numpy allocates (or refuses) first
    if n == 0:
        assert matmul(x, np.ones((k, 0), dtype)).shape == (rows, 0)
    else:
        refused(lambda: matmul(x, np.ones((k, n), dtype)), MemoryError)
    # outer_sum: the rows are summed; the packed copy of x must be addressable
    kpad, item = -(-k // 8) * 8, dtype.itemsize
    if n and rows * n * item > 2**40:
        refused(lambda: outer_sum(x, y), MemoryError)  # y's contiguous copy, refused by numpy
    elif max(kpad * rows * item, rows * 64 * item) > 2**63 - 64:
        refused(lambda: outer_sum(x, y), MemoryError, f"outer_sum: x has {rows} rows of {k}")
    else:
        assert outer_sum(x, y).shape == (x.T @ np.zeros((rows, n), dtype)).shape == (k, n)


def spoilt(how: str, good: np.ndarray) -> Any:
    """``good`` made into an argument the raw kernels refuse, in the way ``how``."""
    if how == "wrong dtype":
        return good.astype(np.float16)
    if how == "byte-swapped":
        return good.astype(good.dtype.newbyteorder())
    if how == "3-d":
        return good[None]
    if how == "misaligned":
        return laid_out(good, "misaligned")
    if how == "read-only":
        return laid_out(good, "readonly")
    if how == "not contiguous":
        return laid_out(good, "strided")
    if how == "wrong shape":
        return np.ones((good.shape[0] + 1, good.shape[1]), good.dtype)
    assert how == "not an array", how
    return good.tolist()


SPOILS = {  # how an operand is spoilt: (the exception, what the message says after its name)
    "wrong dtype": (TypeError, "must be float32 or float64, got buffer format 'e'"),
    "byte-swapped": (TypeError, "must be float32 or float64, got buffer format '>"),
    "3-d": (ValueError, "must be 2-d, got 3-d"),
    "misaligned": (ValueError, "items are not aligned"),
    "read-only": (ValueError, "is read-only"),
    "not contiguous": (ValueError, "must be C-contiguous"),
    "wrong shape": (ValueError, ""),
    "not an array": (TypeError, "must be an array"),
}


@BOUNDED
@given(kind=st.sampled_from(["matmul", "outer_sum"]), which=st.sampled_from([0, 1, 2]),
       how=st.sampled_from(sorted(SPOILS)), dtype=st.sampled_from(FLOATS),
       isa=st.sampled_from(range(kernels.BEST_ISA + 1)))
def test_the_raw_kernels_refuse_a_spoilt_operand_naming_it(kind: str, which: int, how: str, dtype: np.dtype[Any],
                                                           isa: int) -> None:
    """Each operand (inputs, out) spoilt one way at a time: refused, named, with out untouched.
    Inputs may be read-only or strided; out must be writable and C-contiguous."""
    names = ("a", "b", "out") if kind == "matmul" else ("x", "y", "out")
    shapes = [(5, 3), (3, 4), (5, 4)] if kind == "matmul" else [(5, 3), (5, 4), (3, 4)]
    args: list[Any] = [np.ones(s, dtype) for s in shapes]
    allowed = {"read-only", "not contiguous"} if which == 0 or (which == 1 and kind == "matmul") else set()
    if which == 1 and kind == "outer_sum":
        allowed = {"read-only"}  # y may be read-only, but must be contiguous
    assume(how not in allowed)
    args[which] = spoilt(how, args[which])
    sentinel = np.array(args[2], copy=True) if isinstance(args[2], np.ndarray) else None
    exc, says = SPOILS[how]
    if how == "not contiguous" and which == 1:
        says = "y must be C-contiguous"
    call = getattr(kernels, kind)
    message = refused(lambda: call(*args, isa), exc, f"{kind}:", names[which] if how != "wrong shape" else "")
    if how != "wrong shape":
        assert f"{kind}: {names[which]}" in message and says in message, message
    if sentinel is not None:
        assert np.array_equal(np.asarray(args[2]), sentinel, equal_nan=True)


def test_the_raw_kernels_name_the_isa_and_mismatched_shapes() -> None:
    ones = np.ones((2, 2), np.float32)
    refused(lambda: kernels.matmul(ones, ones, ones.copy(), kernels.BEST_ISA + 1), ValueError, "matmul: isa")
    refused(lambda: kernels.outer_sum(ones, ones, ones.copy(), -1), ValueError, "outer_sum: isa -1")
    refused(lambda: kernels.matmul(ones, np.ones((3, 2), np.float32), ones.copy(), 0), ValueError,
            "a is [2, 2] and b [3, 2]")
    refused(lambda: kernels.outer_sum(ones, np.ones((3, 2), np.float32), ones.copy(), 0), ValueError,
            "x and y must have the same rows")
    refused(lambda: kernels.outer_sum(ones[:0], ones[:0], np.ones((2, 2), np.float32), 0), ValueError,
            "at least one")
    refused(lambda: kernels.matmul(ones, ones, np.ones((2, 2)), 0), TypeError, "a, b and out must share one dtype")


# -- the reduction kernel ----------------------------------------------------------------------

#: how an input or the output lies; the kernel runs on those it can read in place (runs_on)
INPUT_LAYOUTS = ["contiguous", "pieces", "readonly", "reversed", "strided", "misaligned"]


def runs_on(layout: str, size: int, output: bool = False) -> bool:
    """Whether the kernel runs on an input (or the output) of ``size`` items laid out so: read in
    place, contiguous and aligned (one item is contiguous whatever its stride, none is aligned)."""
    if layout == "readonly":
        return not output
    if layout in {"reversed", "strided"}:
        return size <= 1
    if layout == "misaligned":
        return size == 0
    return True


def laid_out_1d(values: np.ndarray, layout: str, cuts: list[int]) -> Any:
    if layout == "pieces":
        return np.split(values.copy(), cuts)
    return laid_out(values, layout)


@BOUNDED
@given(members=st.integers(1, 6), dtype=st.sampled_from(FLOATS), size=st.sampled_from([0, 1, 7, 2047, 2049, 5000]),
       data=st.data(), mean=st.booleans())
def test_the_reduction_kernel_runs_or_declines_any_layout(members: int, dtype: np.dtype[Any], size: int,
                                                          data: st.DataObject, mean: bool) -> None:
    """Inputs and out in any layout: where the kernel runs, numpy's bits; where it declines, False
    with out untouched (and numpy then runs the program)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    values = [rng.standard_normal(size).astype(dtype) for _ in range(members)]
    cuts = sorted(data.draw(st.lists(st.integers(0, size), max_size=4), label="cuts"))
    layouts = [data.draw(st.sampled_from(INPUT_LAYOUTS), label=f"input {i}") for i in range(members)]
    out_layout = data.draw(st.sampled_from(["contiguous", "readonly", "reversed", "strided", "misaligned"]),
                           label="out")
    inputs = [laid_out_1d(v, layout, cuts) for v, layout in zip(values, layouts, strict=True)]
    out = laid_out(np.full(size, 7, dtype), out_layout)
    prog = Program((0, members), [(k, k + 1) for k in range(members)])
    divide_by = members if mean else 0
    ran = add_tree(inputs, prog.ops, prog.ntemp, prog.result, out, divide_by)
    event("ran" if ran else "declined")
    assert ran == (all(runs_on(layout, size) for layout in layouts) and runs_on(out_layout, size, output=True))
    with pytest.MonkeyPatch.context() as patch:  # the numpy program over plain copies: the reference
        patch.setattr(reduce, "add_tree", None)
        want = prog.run_blocked([v.copy() for v in values], np.add, np.empty(size, dtype), divide_by)
    assert np.asarray(out).tobytes() == (want.tobytes() if ran else np.full(size, 7, dtype).tobytes())


@BOUNDED
@given(dtype=st.sampled_from(WRONG_DTYPES), where=st.sampled_from(["out", "an input", "a piece"]))
def test_the_reduction_kernel_declines_other_dtypes(dtype: np.dtype[Any], where: str) -> None:
    x = [np.ones(10, np.float32) for _ in range(3)]
    out = np.zeros(10, np.float32)
    if where == "out":
        out = np.zeros(10, dtype)
    elif where == "an input":
        x[1] = x[1].astype(dtype)
    inputs: list[Any] = [[x[0][:4], x[0][4:]], [x[1][:4], x[1][4:].astype(dtype)], x[2]] if where == "a piece" else x
    before = out.copy()
    assert add_tree(inputs, ((0, 1, -1), (-1, 2, -1)), 0, -1, out, 0) is False
    assert out.tobytes() == before.tobytes()


BAD_PROGRAMS: list[tuple[str, Any, Any, int, int, type[Exception], str]] = [
    # (what, inputs (None: three arrays), ops, ntemp, result, exception, message)
    ("ntemp negative", None, ((0, 1, -1),), -1, -1, ValueError, "add_tree: ntemp is -1"),
    ("ntemp past the ops", None, ((0, 1, 3), (3, 2, -1)), 3, -1, ValueError, "add_tree: ntemp is 3"),
    ("ntemp huge", None, ((0, 1, 3), (3, 2, -1)), 2**62, -1, ValueError, "add_tree: ntemp is 4611686018427387904"),
    ("ntemp the largest", None, ((0, 1, -1),), 2**63 - 1, -1, ValueError, "add_tree: ntemp is"),
    ("a slot past every int", None, ((0, 2**70, -1),), 0, -1, ValueError, "add_tree: ops[0] names slot"),
    ("a negative slot", None, ((0, 1, -1), (-2, 1, -1)), 0, -1, ValueError, "add_tree: ops[1] names slot -2"),
    ("an op of two", None, ((0, 1, -1), (0, 1)), 0, -1, TypeError, "add_tree: ops[1] must be an (a, b, dst) triple"),
    ("an op of floats", None, ((0.0, 1, -1),), 0, -1, TypeError, "add_tree: ops[0] must be an (a, b, dst) triple"),
    ("an op that is no sequence", None, (5,), 0, -1, TypeError, "add_tree: ops[0] must be an (a, b, dst) triple"),
    ("ops no sequence", None, 5, 0, -1, TypeError, "add_tree: ops must be a sequence"),
    ("inputs no sequence", 5, (), 0, 0, TypeError, "add_tree: inputs must be a sequence"),
    ("an input no array", "input", ((0, 1, -1),), 0, -1, TypeError, "add_tree: inputs[1] must be an array"),
    ("a piece no array", "piece", ((0, 1, -1),), 0, -1, TypeError, "add_tree: inputs[0][1] must be an array"),
    ("a result past the inputs", None, (), 0, 3, ValueError, "add_tree: result slot 3 is no input"),
    ("a result huge", None, (), 0, 2**62, ValueError, "add_tree: result slot 4611686018427387904"),
    ("pieces longer than out", "long", ((0, 1, -1),), 0, -1, ValueError, "inputs[0] hold more elements than out's 10"),
]


@pytest.mark.parametrize("bad", BAD_PROGRAMS, ids=[b[0] for b in BAD_PROGRAMS])
def test_the_reduction_kernel_refuses_a_bad_program_naming_it(bad: tuple[Any, ...]) -> None:
    _, inputs, ops, ntemp, result, exc, message = bad
    x = [np.ones(10, np.float32) for _ in range(3)]
    out = np.zeros(10, np.float32)
    given_inputs: Any = {None: x, "input": [x[0], "x", x[2]], "piece": [[x[0][:3], None], x[1], x[2]],
                         "long": [[x[0], x[1]], x[1], x[2]]}.get(inputs, inputs)
    refused(lambda: add_tree(given_inputs, ops, ntemp, result, out, 0), exc, message)
    assert not out.any()
    refused(lambda: add_tree(x, ((0, 1, -1),), 0, -1, [0.0] * 10, 0),  # type: ignore[arg-type]  # on purpose
            TypeError, "add_tree: out must be an array")


# -- the swap pass -----------------------------------------------------------------------------

def mostly(right: Any, *wrong: Any) -> st.SearchStrategy[Any]:
    """``right`` half the time, else one of ``wrong``: so that both outcomes are drawn often."""
    return st.one_of(st.just(right), st.sampled_from(wrong))


@BOUNDED
@given(n=st.integers(0, 300), data=st.data(),
       order_dtype=mostly(np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint64), np.dtype(np.float64),
                          np.dtype(">i8")),
       draws_dtype=mostly(np.dtype(np.uint64), np.dtype(np.int64), np.dtype(np.uint32), np.dtype(">u8")),
       order_layout=mostly("contiguous", "readonly", "reversed", "strided", "misaligned", "2-d"),
       draws_layout=mostly("contiguous", "readonly", "reversed", "strided", "misaligned", "2-d"))
def test_the_swap_pass_runs_as_its_python_fallback_or_refuses_naming_the_argument(
        n: int, data: st.DataObject, order_dtype: np.dtype[Any], draws_dtype: np.dtype[Any], order_layout: str,
        draws_layout: str) -> None:
    m = data.draw(st.integers(0, n + 2), label="draws")
    rng = np.random.default_rng(n)
    raw = rng.integers(0, 2**32, m, dtype=np.uint64)

    def arrange(values: np.ndarray, layout: str) -> np.ndarray:
        return values.reshape(1, -1) if layout == "2-d" else laid_out(values, layout)

    order = arrange(np.arange(n).astype(order_dtype), order_layout)
    draws = arrange(raw.astype(draws_dtype), draws_layout)
    before = np.array(order)
    problems = [  # (the argument, what is wrong) in the order the kernel checks them
        ("order", order_dtype != np.dtype(np.int64), TypeError, "order must be int64"),
        ("order", order_layout == "2-d", ValueError, "order must be 1-d"),
        ("order", order_layout in {"reversed", "strided"} and n > 1, ValueError, "order must be contiguous"),
        ("order", order_layout == "misaligned" and n > 0, ValueError, "order's items are not aligned"),
        ("order", order_layout == "readonly", ValueError, "order is read-only"),
        ("draws", draws_dtype != np.dtype(np.uint64), TypeError, "draws must be uint64"),
        ("draws", draws_layout == "2-d", ValueError, "draws must be 1-d"),
        ("draws", draws_layout in {"reversed", "strided"} and m > 1, ValueError, "draws must be contiguous"),
        ("draws", draws_layout == "misaligned" and m > 0, ValueError, "draws's items are not aligned"),
        ("draws", m > n, ValueError, f"draws has {m} values, more than order's {n}"),
    ]
    first = next((p for p in problems if p[1]), None)
    event("swapped" if first is None else f"refused: {first[0]}")
    if first is None:
        want = np.arange(n, dtype=np.int64)
        swap_pass_in_python(want, raw)
        _swaps.swap_pass(order, draws)
        assert order.tolist() == want.tolist()
        return
    refused(lambda: _swaps.swap_pass(order, draws), first[2], f"swap_pass: {first[3]}")
    assert np.array_equal(np.asarray(order), before)


def test_the_swap_pass_refuses_what_is_no_array() -> None:
    refused(lambda: _swaps.swap_pass([0, 1], np.zeros(1, np.uint64)),  # type: ignore[arg-type]  # on purpose
            TypeError, "swap_pass: order must be an array")
    refused(lambda: _swaps.swap_pass(np.arange(2), None),  # type: ignore[arg-type]  # on purpose
            TypeError, "swap_pass: draws must be an array")


# -- the subreaper ---------------------------------------------------------------------------------

def test_the_subreaper_takes_no_arguments() -> None:
    """Its one entry point has nothing to check but that it is given nothing (not called here:
    it would make this test process the subreaper of the whole run's children)."""
    refused(lambda: _subreaper.become(1), TypeError, "takes no arguments")  # type: ignore[call-arg]
