"""A collective's input made of many arrays, read in place: fused reduction without packing.

A fused gradient bucket is the concatenation of many tensors. Packing them into one buffer before
the collective reads and writes every byte once more, which on a CPU costs about as much as the
reduction itself (both are bound by memory bandwidth). :class:`Segments` is that concatenation
without the copy: a flat, read-only sequence of pieces that the engine's reductions read in
place. The blocks of a reduction follow the pieces (:meth:`Segments.cuts`): a piece of at least
:data:`DIRECT` elements is reduced where it lies; runs of smaller pieces are packed a block at a
time into cache-sized scratch (:meth:`Segments.block`), where one ufunc call per piece would cost
more than the copy. Results are bitwise those of the packed array: the same values go through the
same tree.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

#: Pieces of at least this many elements are reduced in place (about 8 KiB of float32); smaller
#: ones are packed in runs, since a ufunc call costs about as much as copying this many elements.
DIRECT = 2048


class Segments:
    """The flat concatenation of ``pieces`` (arrays of one dtype, any shape, read in C order),
    not materialized. ``sizes``: the pieces' element counts when the caller knows them (a fused
    bucket does), which saves looking at every piece."""

    __slots__ = ("_ends", "_pieces", "dtype", "shape", "size")

    ndim = 1

    def __init__(self, pieces: Sequence[np.ndarray], dtype: Any, sizes: Sequence[int] | None = None) -> None:
        self.dtype = np.dtype(dtype)
        self._pieces = list(pieces)
        if sizes is None:
            arrays = [np.asarray(p) for p in self._pieces]
            wrong = [a.dtype for a in arrays if a.dtype != self.dtype]
            if wrong:
                raise TypeError(f"Segments: every piece must have dtype {self.dtype}; got {wrong[0]}")
            self._pieces = arrays
            sizes = [a.size for a in arrays]
        elif len(sizes) != len(self._pieces):
            raise ValueError(f"Segments: {len(self._pieces)} pieces but {len(sizes)} sizes")
        self._ends = list(itertools.accumulate(sizes))
        self.size = self._ends[-1] if self._ends else 0
        self.shape = (self.size,)

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"Segments({len(self._pieces)} pieces, {self.size} x {self.dtype})"

    def reshape(self, *shape: Any) -> Segments:
        """Itself, for ``reshape(-1)`` or ``reshape(size)`` (it is flat); anything else is refused."""
        want = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if tuple(want) not in ((-1,), (self.size,)):
            raise ValueError(f"Segments of {self.size} elements are flat; cannot reshape to {want}")
        return self

    def __getitem__(self, key: slice) -> Segments | np.ndarray:
        """A contiguous range (step 1): a view when it lies in one piece, else the pieces it spans."""
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"Segments take contiguous slices only, got {key!r}")
        lo, hi, _ = key.indices(self.size)
        hi = max(lo, hi)
        first, last = self._span(lo, hi)
        if first == last:
            return self._piece_range(first, lo, hi)
        cut = self._cut(first, last, lo, hi)
        return Segments(cut, self.dtype, [p.size for p in cut])

    def same_pieces(self, other: Segments) -> bool:
        """Whether ``other`` is cut into pieces at the same places (every replica's bucket is)."""
        return self._ends == other._ends

    def cuts(self, block: int) -> list[tuple[int, int, int]]:
        """Ranges ``(lo, hi, piece)`` covering ``[0, size)`` in order, none longer than ``block``:
        each piece of at least :data:`DIRECT` elements on its own (``piece`` is its index when the
        range is the whole piece; longer pieces are split into blocks), the smaller pieces
        between them in runs of at most ``block`` elements (``piece`` is -1: pack them)."""
        out: list[tuple[int, int, int]] = []

        def emit(a: int, b: int) -> None:
            out.extend((c, min(b, c + block), -1) for c in range(a, b, block))

        start = run = 0  # start of the current piece; start of the pending run of small pieces
        for k, end in enumerate(self._ends):
            if end - start >= DIRECT:
                if run < start:
                    emit(run, start)
                if end - start <= block:
                    out.append((start, end, k))
                else:
                    emit(start, end)
                run = end
            elif end - run > block:
                emit(run, start)
                run = start
            start = end
        emit(run, self.size)
        return out

    @property
    def pieces(self) -> list[np.ndarray]:
        """The pieces as given (any shape, read in C order)."""
        return self._pieces

    def flat_pieces(self) -> list[np.ndarray]:
        """The pieces as flat arrays (views)."""
        return [p if p.ndim == 1 else p.reshape(-1) for p in self._pieces]

    def block(self, lo: int, hi: int, scratch: np.ndarray) -> np.ndarray:
        """Elements ``lo:hi`` as a flat array: a view when they lie in one piece, else packed into
        ``scratch[:hi - lo]`` (one copy, of at most a block, so it stays in cache)."""
        first, last = self._span(lo, hi)
        if first == last:
            return self._piece_range(first, lo, hi)
        out = scratch[: hi - lo]
        np.concatenate(self._cut(first, last, lo, hi), axis=None, out=out)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The packed array (a new one)."""
        out = np.concatenate(self._pieces, axis=None) if self._pieces else np.empty(0, self.dtype)
        return out if dtype is None else out.astype(dtype, copy=False)

    def _span(self, lo: int, hi: int) -> tuple[int, int]:
        """The pieces holding element ``lo`` and element ``hi - 1`` (equal for an empty range)."""
        first = bisect.bisect_right(self._ends, lo)
        last = bisect.bisect_right(self._ends, hi - 1) if hi > lo else first
        return first, last

    def _start(self, index: int) -> int:
        return self._ends[index - 1] if index else 0

    def _piece_range(self, index: int, lo: int, hi: int) -> np.ndarray:
        if index >= len(self._pieces):  # an empty range at the end
            return np.empty(0, self.dtype)
        start = self._start(index)
        return self._pieces[index].reshape(-1)[lo - start:hi - start]

    def _cut(self, first: int, last: int, lo: int, hi: int) -> list[np.ndarray]:
        """The pieces ``first..last``, flat, trimmed to ``lo:hi``."""
        head = self._pieces[first].reshape(-1)[lo - self._start(first):]
        tail = self._pieces[last].reshape(-1)[:hi - self._start(last)]
        return [head, *self._pieces[first + 1:last], tail]


def dense(x: Any) -> np.ndarray:
    """``x`` as an array: Segments are packed, arrays returned as they are."""
    return np.asarray(x) if type(x) is Segments else x


__all__ = ["DIRECT", "Segments", "dense"]
