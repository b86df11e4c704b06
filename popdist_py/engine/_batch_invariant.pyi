"""The compiled kernels of :mod:`popdist_py.engine.batch_invariant` (``_batch_invariant.c``): 2-d
float32 or float64 operands of one dtype, items aligned, ``out`` writable and C-contiguous (and
outer_sum's ``y`` contiguous); anything else is refused with TypeError, ValueError or MemoryError
naming the operand."""

from typing import Any

KC: int
BEST_ISA: int

def matmul(a: Any, b: Any, out: Any, isa: int, /) -> None: ...
def outer_sum(x: Any, y: Any, out: Any, isa: int, /) -> None: ...
