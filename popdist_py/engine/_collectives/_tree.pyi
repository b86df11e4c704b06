from collections.abc import Sequence

import numpy as np

def add_tree(inputs: Sequence[np.ndarray | list[np.ndarray]], ops: Sequence[tuple[int, int, int]], ntemp: int,
             result: int, out: np.ndarray, divisor: float) -> bool:
    """Run a reduction program of additions into ``out`` (float32 or float64); False, with nothing
    written, when a buffer is of another dtype, not contiguous or misaligned, ``out`` is read-only, or the
    lists are cut differently; TypeError or ValueError naming a malformed argument (no array, a slot
    outside the program, ``ntemp`` past the ops)."""
