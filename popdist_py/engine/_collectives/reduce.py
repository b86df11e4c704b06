"""The canonical reduction order: a fixed binary tree over a group's member order.

Float addition is not associative, so a result that must not depend on how replicas are split
between instances needs one fixed order. The order used everywhere is the tree over members
``m0 .. m(G-1)`` that splits ``[lo, hi)`` at ``lo + p`` where ``p`` is the largest power of two
strictly below ``hi - lo`` (a perfectly aligned segment tree: ``((m0+m1)+(m2+m3)) + (m4+m5)``
for six members). Any contiguous run of members held by one process decomposes into a few
complete nodes of that tree (:func:`decompose`); a process reduces those nodes locally and the
remaining nodes are combined, in the same tree, after the pieces have been exchanged
(a :class:`Program` over the pieces). Every element goes through the same sequence of IEEE operations whichever
process does them, so results are bitwise identical for any split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from popcontract import compiled
from popdist_py.engine._collectives.segments import Segments
from popdist_py.op_names import ARITHMETIC, ENGINE_OPS, LOGICAL, SQUARE_ADD, TO_ENGINE

Node = tuple[int, int]


def _kernel() -> Callable[[Sequence[Any], Sequence[tuple[int, int, int]], int, int, np.ndarray, float], bool] | None:
    tree = compiled.load(compiled.TREE)  # built without it: numpy runs every program, to the same bits
    return None if tree is None else tree.add_tree


#: The compiled runner of programs of additions (``_tree.c``), or None where it was not built.
add_tree = _kernel()

#: Binary ufuncs for the reduction ops. mean is add followed by a division by the group size;
#: square_add is add over inputs squared first (each by its own replica, before any combining),
#: so every op keeps one fixed tree and split-independent bits.
UFUNCS: dict[str, np.ufunc] = {
    "add": np.add,
    "mean": np.add,
    "mul": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
    SQUARE_ADD: np.add,
    LOGICAL[0]: np.logical_and,
    LOGICAL[1]: np.logical_or,
}
assert tuple(UFUNCS) == ENGINE_OPS
#: The arithmetic ops; :data:`ALL_OPS` adds PopXL's square_add, and, or.
OPS = ARITHMETIC
ALL_OPS = ENGINE_OPS


def reduction_op(op: object, what: str = "reduction") -> str:
    """The engine's name of reduction op ``op`` (one of :data:`ALL_OPS`, or an alias: ``sum`` is
    ``add``, ``prod`` is ``mul``); ValueError naming ``what`` and the valid ops otherwise."""
    if isinstance(op, str):
        name = TO_ENGINE.get(op, op)
        if name in UFUNCS:
            return name
    raise ValueError(f"{what}: op={op!r} is not supported; use one of {', '.join(OPS)} "
                     f"(or {', '.join(f'{a} for {b}' for a, b in TO_ENGINE.items())}), "
                     f"{SQUARE_ADD} (the sum of squares), or on bool inputs {' or '.join(LOGICAL)}")


def check_operands(op: str, dtype: np.dtype, what: str) -> None:
    """TypeError naming ``what`` when ``op`` (an engine name) is not defined for ``dtype``."""
    kind = dtype.kind
    if op == "mean" and kind not in "fc":
        raise TypeError(f"{what}: op='mean' needs a floating-point input, got dtype {dtype}")
    if op in LOGICAL and kind != "b":
        raise TypeError(f"{what}: op={op!r} is logical and takes bool inputs only (as PopXL's), got dtype {dtype}; "
                        "compare first, e.g. x != 0")
    if op == SQUARE_ADD and kind not in "iuf":
        raise TypeError(f"{what}: op={SQUARE_ADD!r} needs an integer or floating-point input, got dtype {dtype}")


def prepare(op: str, x: np.ndarray) -> np.ndarray:
    """What a replica contributes to reduction ``op``: ``x`` itself, or for square_add its square."""
    return np.square(x) if op == SQUARE_ADD else x


def split(lo: int, hi: int) -> int:
    """Where node ``[lo, hi)`` (two or more members) splits into its left and right children."""
    n = hi - lo
    return lo + (1 << ((n - 1).bit_length() - 1))


def decompose(a: int, b: int, size: int) -> list[Node]:
    """The maximal complete nodes of the tree over ``[0, size)`` that exactly cover ``[a, b)``, in order."""
    out: list[Node] = []

    def visit(lo: int, hi: int) -> None:
        if hi <= a or b <= lo:
            return
        if a <= lo and hi <= b:
            out.append((lo, hi))
            return
        mid = split(lo, hi)
        visit(lo, mid)
        visit(mid, hi)

    if 0 <= a < b <= size:
        visit(0, size)
    return out


#: Elements per block of :meth:`Program.run_blocked` (about 512 KiB of float32): each block's
#: intermediate values stay in cache, so a tree over several arrays streams memory once.
BLOCK = 1 << 17


class Program:
    """The evaluation of ``node`` from ``inputs`` (nodes covering it), compiled once.

    ``ops`` is a list of ``(a, b, dst)`` slot triples: slots ``0..len(inputs)-1`` are the input
    arrays, then temporaries, and slot ``-1`` is the output. Running it costs one ufunc call per
    internal node and no Python-level tree walking, which matters for small collectives.
    """

    __slots__ = ("ninputs", "ntemp", "ops", "pair", "result")

    def __init__(self, node: Node, inputs: Sequence[Node]) -> None:
        index = {n: i for i, n in enumerate(inputs)}
        self.ninputs = len(inputs)
        ops: list[tuple[int, int, int]] = []
        temps = 0

        def comp(nd: Node, to_out: bool) -> tuple[int, bool]:
            nonlocal temps
            hit = index.get(nd)
            if hit is not None:
                return hit, False
            lo, hi = nd
            if hi - lo < 2:
                raise KeyError(f"member {lo} of the reduction is missing")
            mid = split(lo, hi)
            left, left_owned = comp((lo, mid), to_out)
            right, right_owned = comp((mid, hi), False)
            if to_out:
                dst = -1
            elif left_owned:
                dst = left
            elif right_owned:
                dst = right
            else:
                dst = self.ninputs + temps
                temps += 1
            ops.append((left, right, dst))
            return dst, True

        self.result, _ = comp(node, True)
        self.ops = tuple(ops)
        self.ntemp = temps
        #: the inputs of a program that is one ufunc call into the output (two members)
        self.pair = ops[0][:2] if len(ops) == 1 else None

    def run(self, inputs: Sequence[np.ndarray], ufunc: np.ufunc, out: np.ndarray,
            temps: Sequence[np.ndarray] = ()) -> np.ndarray:
        """The program on arrays of ``out``'s shape; ``temps``: 1-D scratch arrays of at least
        ``out.size`` elements to hold the intermediate nodes (default: new ones)."""
        pair = self.pair
        if pair is not None:  # the common small case, without building the slot list
            ufunc(inputs[pair[0]], inputs[pair[1]], out=out)
            return out
        if not self.ops:
            np.copyto(out, inputs[self.result])
            return out
        slots = list(inputs)
        if temps:
            slots.extend(t[:out.size].reshape(out.shape) for t in temps[:self.ntemp])
        else:
            slots.extend(np.empty_like(out) for _ in range(self.ntemp))
        slots.append(out)
        for a, b, d in self.ops:
            ufunc(slots[a], slots[b], out=slots[d])
        return out

    def run_blocked(
        self, inputs: Sequence[Any], ufunc: np.ufunc, out: np.ndarray, divide_by: int = 0, block: int = BLOCK
    ) -> np.ndarray:
        """:meth:`run` on 1-D arrays block by block (intermediates stay in cache), then ``/ divide_by``.

        Inputs may be :class:`.segments.Segments` (arrays in pieces, read in place). Additions of
        float32 or float64 run in one call of the compiled kernel (``_tree.c``: one ufunc call per
        node and piece costs about 1.5 us a piece, a third of reducing a 16 KiB gradient). In
        numpy, the blocks follow the pieces (:func:`.segments.cuts`), so a large piece is reduced
        where it is and only runs of small pieces are packed, a block at a time into cache-sized
        scratch."""
        if ufunc is np.add and add_tree is not None and add_tree(
                [a.pieces if type(a) is Segments else a for a in inputs], self.ops, self.ntemp, self.result, out,
                divide_by):
            return out
        m = out.shape[0]
        segmented = [i for i, a in enumerate(inputs) if type(a) is Segments]
        if segmented:
            self._run_pieces(inputs, segmented, ufunc, out, block, divide_by)
            return out
        if m <= block:
            self.run(inputs, ufunc, out)
            if divide_by:
                finish_mean(out, divide_by)
            return out
        for b0 in range(0, m, block):
            b1 = min(m, b0 + block)
            part = out[b0:b1]
            self.run([a[b0:b1] for a in inputs], ufunc, part)
            if divide_by:
                finish_mean(part, divide_by)
        return out

    def _run_pieces(self, inputs: Sequence[Any], segmented: list[int], ufunc: np.ufunc, out: np.ndarray,
                    block: int, divide_by: int) -> None:
        """:meth:`run_blocked` with Segments among the inputs (see there); the loop is kept tight
        because a fused bucket has a span per tensor."""
        first = inputs[segmented[0]]
        m = out.shape[0]
        pieces: list[Any] = []
        rows = None
        if all(inputs[i].same_pieces(first) for i in segmented[1:]):
            spans = first.cuts(block)
            pieces = [a.flat_pieces() if type(a) is Segments else None for a in inputs]
            if len(segmented) == len(inputs):  # piece k of every input (a job of local members only)
                rows = list(zip(*pieces, strict=True))
        else:  # pieces cut differently: plain blocks, packed where they span pieces
            spans = [(b0, min(m, b0 + block), -1) for b0 in range(0, m, block)]
        width = max((hi - lo for lo, hi, _ in spans), default=0)
        scratch = [np.empty(width, out.dtype) if type(a) is Segments else None for a in inputs]
        temps = [np.empty(width, out.dtype) for _ in range(self.ntemp)]
        sized: dict[int, list[np.ndarray]] = {}  # the temps cut to a span's length
        ops, result = self.ops, self.result
        divisor = out.dtype.type(divide_by) if divide_by else None
        undivided = 0  # the mean's division, a block at a time while the block is still in cache
        for lo, hi, k in spans:
            if k < 0:
                slots = [a[lo:hi] if t is None else a.block(lo, hi, t) for a, t in zip(inputs, scratch, strict=True)]
            elif rows is not None:  # one whole piece of every input: read in place
                slots = [*rows[k]]
            else:
                slots = [a[lo:hi] if p is None else p[k] for a, p in zip(inputs, pieces, strict=True)]
            target = out[lo:hi]
            if ops:
                n = hi - lo
                cut = sized.get(n)
                if cut is None:
                    cut = sized[n] = [t[:n] for t in temps]
                slots += cut
                slots.append(target)
                for a, b, d in ops:
                    ufunc(slots[a], slots[b], out=slots[d])
            else:
                np.copyto(target, slots[result])
            if divisor is not None and (hi - undivided >= block or hi == m):
                done = out[undivided:hi]
                np.divide(done, divisor, out=done)
                undivided = hi


def reduce_sequence(values: Sequence[np.ndarray], op: str = "add") -> np.ndarray:
    """Reference: the canonical tree over ``values`` (member order), computed directly.

    Kept independent of :class:`Program` so tests can check the engine against it.
    """
    op = reduction_op(op, "reduce_sequence")
    ufunc = UFUNCS[op]

    def rec(lo: int, hi: int) -> np.ndarray:
        if hi - lo == 1:
            return prepare(op, np.asarray(values[lo]))
        mid = split(lo, hi)
        combined: np.ndarray = ufunc(rec(lo, mid), rec(mid, hi))
        return combined

    if not values:
        raise ValueError("nothing to reduce")
    result = np.array(rec(0, len(values)), copy=True)
    if op == "mean":
        finish_mean(result, len(values))
    return result


def finish_mean(total: np.ndarray, group_size: int) -> None:
    """In place: the mean from the sum (the same division on every process, so still bitwise stable)."""
    np.divide(total, total.dtype.type(group_size), out=total)
