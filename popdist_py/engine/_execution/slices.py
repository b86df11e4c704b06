"""A large collective's local work, cut into contiguous slices of elements run on the instance's cores.

Summing the local replicas' inputs, or copying them into an all-gather's result, is elementwise
work that streams memory once; one thread gets one core's share of the memory bandwidth and
faults in a fresh result's pages alone. A :class:`Slicer` cuts such work into contiguous slices
of elements, runs the first on the calling thread and the others on its own threads (numpy and
the reduction kernel release the GIL), and returns when all are done. Every element still goes
through the same operations, so the bits do not depend on the number of threads.

Work is cut only into slices of at least :data:`MIN_SLICE_BYTES` (streamed bytes: inputs and
output): handing a slice to a thread and waiting for it costs tens of microseconds, and on the
2-core virtual machines this project is built on, two threads gained nothing until the work
left the caches (all-reduce, 2 and 4 local replicas: 0.7-1.2x the one-thread time at 1 to 16
MiB per replica, 1.2-1.5x at 64 MiB).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

#: The least bytes (read and written) a slice is given; smaller work runs whole on the caller.
MIN_SLICE_BYTES = 16 << 20

#: Slice boundaries fall on multiples of this many elements, so no two threads write one page
#: (4 KiB of float32) and a fresh result's pages are each faulted in by one thread.
ALIGN = 1024


class Slicer:
    """Runs ``fn(lo, hi)`` over slices covering ``[0, n)`` on up to ``threads`` threads.

    The threads (``threads - 1``: the caller runs a slice too) start with the first work that is
    large enough to cut, and stop at :meth:`shutdown`.
    """

    def __init__(self, threads: int, name: str = "slice", min_bytes: int = MIN_SLICE_BYTES) -> None:
        if threads < 1:
            raise ValueError(f"threads={threads!r} must be >= 1")
        self.threads = threads
        #: the least bytes a slice is given (:data:`MIN_SLICE_BYTES`; tests lower it)
        self.min_bytes = min_bytes
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        #: how many calls of :meth:`run` were cut into several slices
        self.split_runs = 0

    def splits(self, nbytes: int) -> bool:
        """Whether work streaming ``nbytes`` is large enough to be cut (at least two slices)."""
        return self.threads > 1 and nbytes >= 2 * self.min_bytes

    def cuts(self, n: int, nbytes: int) -> list[tuple[int, int]]:
        """The slices ``[(lo, hi), ...]`` that cover ``[0, n)`` for work streaming ``nbytes`` in all:
        as many as there are threads, each of at least :attr:`min_bytes`, ends aligned."""
        count = min(self.threads, nbytes // self.min_bytes, n // ALIGN)
        if count <= 1:
            return [(0, n)]
        # at least ALIGN elements a slice (count <= n // ALIGN): the ends rise strictly
        ends = [0, *((n * i // count) // ALIGN * ALIGN for i in range(1, count)), n]
        return list(itertools.pairwise(ends))

    def run(self, fn: Callable[[int, int], object], n: int, nbytes: int) -> int:
        """``fn(lo, hi)`` for each of :meth:`cuts`; the number of slices run. The first failure is
        raised once every slice has finished (none is left writing)."""
        slices = self.cuts(n, nbytes)
        if len(slices) == 1:
            fn(0, n)
            return 1
        self.split_runs += 1
        pool = self._executor()
        futures: list[Future[object]] = [pool.submit(fn, lo, hi) for lo, hi in slices[1:]]
        try:
            fn(*slices[0])
        finally:
            errors = [f.exception() for f in futures]  # waits for each
        for error in errors:
            if error is not None:
                raise error
        return len(slices)

    def _executor(self) -> ThreadPoolExecutor:
        pool = self._pool
        if pool is None or self._pid != os.getpid():  # a forked child has none of the parent's threads
            pool = self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix=self._name)
            self._pid = os.getpid()
        return pool

    def shutdown(self) -> None:
        """Stop the threads (idempotent); a later :meth:`run` starts new ones."""
        pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True)
