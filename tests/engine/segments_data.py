"""Gradients and pieces of many sizes the segments tests reduce, in one process and under mpiexec."""

from __future__ import annotations

from typing import Any

import numpy as np

from popdist_py.engine._collectives.reduce import BLOCK
from popdist_py.engine._collectives.segments import DIRECT

#: piece sizes: tiny, around DIRECT, and longer than a block

MIXED = [1, 7, DIRECT - 1, DIRECT, 3000, 5, 9, BLOCK + 123, 0, 40, 2 * DIRECT + 1]


def pieces(rng: np.random.Generator, sizes: list[int], dtype: Any = np.float32) -> list[np.ndarray]:
    """Random pieces of ``sizes`` elements, some 2-D (read in C order)."""
    out = []
    for k, n in enumerate(sizes):
        a = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype)
        out.append(a.reshape(n // 7, 7) if k % 3 == 1 and n % 7 == 0 and n else a)
    return out


def gradients(rng: np.random.Generator, R: int) -> tuple[dict[str, tuple[int, ...]], list[dict[str, np.ndarray]]]:
    shapes = {f"t{k}": shape for k, shape in enumerate([(3,), (64, 64), (5, 7), (DIRECT + 3,), (1,), (300, 200),
                                                          (2, 2), (BLOCK + 5,), (11,)])}
    return shapes, [{n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()} for _ in range(R)]
