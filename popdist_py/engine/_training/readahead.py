"""Reading off-chip tensors ahead of their use on background threads (PopART's loadTileSet=IO).

PopART streams a tensor marked for IO loading onto IO tiles while the compute tiles work on the
previous one. Here a replica walks its tensors in order; :meth:`ReadAhead.in_order` starts the
next tensor's load on a worker thread before handing out the current one, so mapping its
memory-mapped pages in (the page faults and any disk reads, outside the GIL) overlaps the current
tensor's computation. Loads touch no step context and no collective, so they may run on any
thread, under either executor.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

#: A load and whether it may run ahead (True: read ahead on a worker; False: when its turn comes).
Job = tuple[Callable[[], T], bool]


class ReadAhead:
    """Worker threads for read-ahead loads, started on first use (one per local replica at most,
    since each replica keeps at most one load in flight)."""

    def __init__(self, workers: int) -> None:
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._finalizer: weakref.finalize[..., ReadAhead] | None = None

    def _submit(self, job: Callable[[], T]) -> Future[T]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="read-ahead")
            self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=False)
        return self._pool.submit(job)

    def in_order(self, jobs: Sequence[Job[T]]) -> Iterator[T]:
        """The jobs' results in order; while result ``k`` is used, job ``k + 1`` runs ahead if it may."""
        pending: Future[T] | None = None
        for k, (job, _) in enumerate(jobs):
            value = pending.result() if pending is not None else job()
            pending = None
            if k + 1 < len(jobs) and jobs[k + 1][1]:
                pending = self._submit(jobs[k + 1][0])
            yield value

    def close(self) -> None:
        """Stop the workers (waiting for loads in flight). Idempotent."""
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


__all__ = ["Job", "ReadAhead"]
