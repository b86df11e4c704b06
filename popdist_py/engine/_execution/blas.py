"""The BLAS library's threads, shared by replica threads that compute at once.

A BLAS library (OpenBLAS in numpy's wheels) keeps one pool of threads per process, sized for the
whole process: poprun sets ``OMP_NUM_THREADS`` to the instance's cores. Under the threads
executor, L replicas call it at once, each call asking for the whole pool: L times the threads
the cores can run, contending with each other and with the replicas' own numpy work. While a
:class:`.pool.ReplicaPool` runs a step, :class:`BlasShare` gives each BLAS library its threads
divided by L (at least one), and sets them back after; the cooperative executor, which runs one
replica at a time, leaves them whole. Measured by hand on 2026-11-27 with the bench's training
worker (1 x 2 replicas on 2 cores, BLAS on poprun's 2 threads): 17k samples/s without the share,
21k with it, as much as with one BLAS thread.

The libraries are those loaded when the pool runs its first step (``threadpoolctl`` finds them).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any


class BlasShare:
    """Each loaded BLAS library's threads divided among ``sharers`` concurrent callers."""

    def __init__(self, sharers: int) -> None:
        self.sharers = sharers
        self._blas: Any = None  # threadpoolctl's controller of the BLAS libraries, found at the first use

    def shared(self) -> AbstractContextManager[object]:
        """A context in which each BLAS library runs on ``max(1, its threads // sharers)`` threads."""
        blas = self._blas
        if blas is None:
            from threadpoolctl import ThreadpoolController

            blas = self._blas = ThreadpoolController().select(user_api="blas")
        limits = {lib.prefix: max(1, lib.num_threads // self.sharers) for lib in blas.lib_controllers}
        if not limits:
            return nullcontext()
        limiter: AbstractContextManager[object] = blas.limit(limits=limits)
        return limiter
