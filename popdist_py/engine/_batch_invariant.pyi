"""The compiled kernels of :mod:`popdist_py.engine.batch_invariant` (``_batch_invariant.c``)."""

from typing import Any

KC: int
BEST_ISA: int

def matmul(a: Any, b: Any, out: Any, isa: int, /) -> None: ...
def outer_sum(x: Any, y: Any, out: Any, isa: int, /) -> None: ...
