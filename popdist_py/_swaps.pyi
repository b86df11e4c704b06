import numpy as np

def swap_pass(order: np.ndarray, draws: np.ndarray) -> None:
    """For each i in turn, swap order[i] with order[i + draws[i] % (n - i)] (int64 order, uint64 draws)."""
