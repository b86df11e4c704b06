"""How many threads an instance's program gets: its host's supervisor sets ``OMP_NUM_THREADS`` from it, poprun
says it (``--verbose``)."""

from __future__ import annotations

import os


def threads_per_instance(per_host: int) -> int:
    """This host's usable cores (its CPU affinity) divided by its ``per_host`` instances, at least 1."""
    return max(1, len(os.sched_getaffinity(0)) // per_host)
