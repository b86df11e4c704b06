"""The compiled reduction kernel (``_tree.c``): the bits of the numpy program it replaces, for any
number of members, dtype, layout of pieces and mean; and where it is not the case for it, it
declines with nothing written and numpy runs the program."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from popdist_py.engine._collectives import reduce
from popdist_py.engine._collectives.reduce import Program, reduce_sequence
from popdist_py.engine._collectives.segments import Segments
from tests.engine.segments_data import MIXED, pieces

pytestmark = pytest.mark.one_executor  # no Runtime here

#: piece sizes around the kernel's chunk of 2048 elements, and empty ones
SIZES = [0, 1, 2047, 2048, 2049, 4096, 6001, 0, 3]


def special(rng: np.random.Generator, n: int, dtype: Any) -> np.ndarray:
    """Values over many magnitudes with every special value in them: nan, infinities, -0.0,
    subnormals and the largest finite (whose sums overflow)."""
    info = np.finfo(dtype)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 7, n)).astype(dtype)
    odd = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, info.tiny / 4, -info.tiny / 8, info.max, -info.max], dtype)
    where = rng.choice(n, min(n, 3 * odd.size), replace=False) if n else np.zeros(0, int)
    x[where] = odd[np.arange(where.size) % odd.size]
    return x


def numpy_program(prog: Program, inputs: list[Any], out: np.ndarray, divide_by: int,
                  monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    with monkeypatch.context() as m:
        m.setattr(reduce, "add_tree", None)
        return prog.run_blocked(inputs, np.add, out, divide_by)


def test_the_kernel_is_built() -> None:
    assert reduce.add_tree is not None, "popdist_py/engine/_collectives/_tree.c was not built with the package"


@pytest.mark.determinism
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("members", [1, 2, 3, 4, 5, 6])
def test_the_kernel_gives_the_bits_of_numpy(dtype: Any, members: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(members)
    kernel = reduce.add_tree
    assert kernel is not None
    packed = [special(rng, sum(SIZES), dtype) for _ in range(members)]
    cut = [np.split(p, np.cumsum(SIZES)[:-1]) for p in packed]
    prog = Program((0, members), [(k, k + 1) for k in range(members)])
    reference = reduce_sequence(packed, "add")
    for divide_by in (0, members):
        expect = numpy_program(prog, packed, np.empty_like(packed[0]), divide_by, monkeypatch)
        if divide_by == 0:
            assert expect.tobytes() == reference.tobytes()
        layouts: dict[str, list[Any]] = {"arrays": packed, "pieces": [Segments(c, dtype) for c in cut],
                   "mixed": [packed[0], *(Segments(c, dtype) for c in cut[1:])]}
        for name, inputs in layouts.items():
            out = np.full_like(packed[0], 7)
            assert kernel([a.pieces if type(a) is Segments else a for a in inputs], prog.ops, prog.ntemp,
                          prog.result, out, divide_by), name
            assert out.tobytes() == expect.tobytes(), (name, divide_by)


def test_the_kernel_reads_pieces_of_any_shape_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    inputs = [pieces(rng, MIXED) for _ in range(4)]  # some 2-D, one longer than numpy's block
    before = [[p.copy() for p in ps] for ps in inputs]
    prog = Program((0, 4), [(k, k + 1) for k in range(4)])
    segments = [Segments(ps, np.float32) for ps in inputs]
    expect = numpy_program(prog, segments, np.empty(sum(MIXED), np.float32), 4, monkeypatch)
    kernel = reduce.add_tree
    assert kernel is not None
    got = np.empty(sum(MIXED), np.float32)
    assert kernel(inputs, prog.ops, prog.ntemp, prog.result, got, 4)  # it ran: 2-D pieces read in place
    assert got.tobytes() == expect.tobytes()
    assert all(a.tobytes() == b.tobytes() for ps, bs in zip(inputs, before, strict=True)
               for a, b in zip(ps, bs, strict=True))


def test_the_kernel_declines_what_it_does_not_do_and_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other dtypes, buffers it cannot read in place, lists cut differently: False, the output as it
    was; the program then runs in numpy with the same result."""
    kernel = reduce.add_tree
    assert kernel is not None
    rng = np.random.default_rng(3)
    prog = Program((0, 3), [(0, 1), (1, 2), (2, 3)])
    x = [rng.standard_normal(12).astype(np.float32) for _ in range(3)]
    declined: dict[str, tuple[list[Any], np.ndarray]] = {
        "int32": ([a.astype(np.int32) for a in x], np.zeros(12, np.int32)),
        "float16": ([a.astype(np.float16) for a in x], np.zeros(12, np.float16)),
        "byte-swapped": ([a.astype(">f4") for a in x], np.zeros(12, ">f4")),
        "a float64 input": ([x[0].astype(np.float64), *x[1:]], np.zeros(12, np.float32)),
        "a strided input": ([np.repeat(x[0], 2)[::2], *x[1:]], np.zeros(12, np.float32)),
        "a strided piece": ([[np.repeat(x[0], 2)[::2]], [x[1]], [x[2]]], np.zeros(12, np.float32)),
        "cut differently": ([[x[0][:5], x[0][5:]], [x[1][:6], x[1][6:]], x[2]], np.zeros(12, np.float32)),
        "fewer pieces": ([[x[0][:5], x[0][5:]], [x[1]], x[2]], np.zeros(12, np.float32)),
    }
    for name, (inputs, out) in declined.items():
        assert not kernel(inputs, prog.ops, prog.ntemp, prog.result, out, 0), name
        assert not out.any(), name
    readonly = np.zeros(12, np.float32)
    readonly.flags.writeable = False
    assert not kernel(x, prog.ops, prog.ntemp, prog.result, readonly, 0)
    strided_out = np.zeros(24, np.float32)[::2]
    assert not kernel(x, prog.ops, prog.ntemp, prog.result, strided_out, 0)
    assert not strided_out.any()
    # numpy runs what the kernel declined, with the kernel's bits where it would have run
    expect = numpy_program(prog, x, np.empty(12, np.float32), 3, monkeypatch)
    odd = [Segments([a[:k + 4], a[k + 4:]], np.float32) for k, a in enumerate(x)]
    assert prog.run_blocked(odd, np.add, np.empty(12, np.float32), 3).tobytes() == expect.tobytes()
    ints = [np.arange(12, dtype=np.int32) * k for k in range(3)]
    assert prog.run_blocked(ints, np.add, np.empty(12, np.int32)).tolist() == (np.arange(12) * 3).tolist()


def test_the_kernel_refuses_a_program_or_lengths_that_do_not_fit() -> None:
    kernel = reduce.add_tree
    assert kernel is not None
    x = [np.ones(8, np.float32) for _ in range(2)]
    out = np.zeros(8, np.float32)
    bad: list[tuple[list[Any], Any, int, int, str]] = [
        (x, ((0, 2, -1),), 0, -1, r"ops\[0\] names slot 2"),  # no temporaries to read
        (x, ((0, 1, 0),), 0, -1, r"ops\[0\] names slot 0"),  # an input is never written
        (x, ((0, 1, 3),), 1, -1, r"ops\[0\] names slot 3"),
        (x, (), 0, 2, "result slot"),
        ([], (), 0, 0, "no inputs"),
        ([x[0], np.ones(9, np.float32)], ((0, 1, -1),), 0, -1, r"inputs\[1\] has 9 elements, out 8"),
        ([[x[0][:3]], x[1]], ((0, 1, -1),), 0, -1, r"the pieces of inputs\[0\] hold 3 elements, out 8"),
    ]
    for inputs, ops, ntemp, result, message in bad:
        with pytest.raises(ValueError, match=message):
            kernel(inputs, ops, ntemp, result, out, 0)
        assert not out.any(), message
    with pytest.raises(TypeError):
        kernel(x, ((0, 1),), 0, -1, out, 0)  # type: ignore[arg-type]


def test_programs_of_float_additions_go_to_the_kernel_and_the_others_to_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every addition is offered to the kernel, which runs those of float32/float64 (arrays or
    pieces: its result is the one returned) and declines the others; other ops never reach it."""
    kernel = reduce.add_tree
    assert kernel is not None
    calls: list[str] = []

    def counting(inputs: list[Any], *rest: Any) -> bool:
        ran = kernel(inputs, *rest)
        calls.append(f"{rest[3].dtype} {'ran' if ran else 'declined'}")
        return ran

    monkeypatch.setattr(reduce, "add_tree", counting)
    prog = Program((0, 3), [(0, 1), (1, 2), (2, 3)])
    rng = np.random.default_rng(4)
    for dtype in (np.float32, np.float64):
        xs = [rng.standard_normal(5000).astype(dtype) for _ in range(3)]
        expect = reduce_sequence(xs, "mean")
        assert prog.run_blocked(xs, np.add, np.empty(5000, dtype), 3).tobytes() == expect.tobytes()
        pieces = [Segments(np.array_split(x, 4), dtype) for x in xs]
        assert prog.run_blocked(pieces, np.add, np.empty(5000, dtype), 3).tobytes() == expect.tobytes()
    assert calls == ["float32 ran"] * 2 + ["float64 ran"] * 2
    ints = [np.arange(10, dtype=np.int32) for _ in range(3)]
    assert prog.run_blocked(ints, np.add, np.empty(10, np.int32)).tolist() == (np.arange(10) * 3).tolist()
    floats = [rng.standard_normal(10).astype(np.float32) for _ in range(3)]
    assert prog.run_blocked(floats, np.maximum, np.empty(10, np.float32)).tobytes() == \
        reduce_sequence(floats, "max").tobytes()
    assert calls[4:] == ["int32 declined"]
