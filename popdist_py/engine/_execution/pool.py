"""A persistent pool of replica threads owned by a Runtime.

Local replica 0 runs on the thread that called ``Runtime.run`` and replicas 1..L-1 on L-1
long-lived worker threads, so a run costs one wake-up per worker and no thread creation; with
L == 1 a step runs directly on the caller's thread. While a step runs, the replicas share the
BLAS library's threads (:mod:`.blas`). Workers reference only the pool (never the
runtime), so a runtime that is dropped without ``close()`` can still be collected, which shuts
the pool down.
"""

from __future__ import annotations

import logging
import threading

from popdist_py.engine._execution.blas import BlasShare
from popdist_py.engine._execution.executor import MAX_THREADS, Stall, Task

log = logging.getLogger(__name__)

_STOP = object()



class ReplicaPool:
    """The threads executor (:class:`.executor.ReplicaExecutor`): replica 0 on the caller's thread,
    the others on persistent worker threads."""

    def __init__(self, size: int, name: str = "replica") -> None:
        self.size = size
        self._go = [threading.Lock() for _ in range(size)]
        for lock in self._go:
            lock.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._count_lock = threading.Lock()
        self._pending = 0
        self._task: object = None
        self._closed = False
        #: while a step runs, the replicas share the BLAS library's threads
        self.blas = BlasShare(size)
        if size > MAX_THREADS:
            raise ValueError(
                f"the threads executor runs at most {MAX_THREADS} local replicas (one thread each), not {size}: "
                'use executor="cooperative" (or "auto")'
            )
        self._threads: list[threading.Thread] = []
        for i in range(1, size):
            t = threading.Thread(target=self._worker, args=(i,), name=f"{name}-{i}", daemon=True)
            try:
                t.start()
            except RuntimeError as exc:  # "can't start new thread": the OS's limit on threads
                started = len(self._threads)
                self.shutdown()
                raise RuntimeError(
                    f"could not start replica thread {i} of the {size - 1} that {size} local replicas need "
                    f"({exc}); the {started} started were stopped: use fewer local replicas or "
                    'executor="cooperative"'
                ) from exc
            self._threads.append(t)

    def _worker(self, index: int) -> None:
        go = self._go[index]
        while True:
            go.acquire()
            task = self._task
            if task is _STOP:
                return
            try:
                task(index)  # type: ignore[operator]
            except BaseException:  # the task records its own errors; never let a worker die
                log.exception("replica task %d raised", index)
            task = None  # the task's closure holds the runtime: do not keep it alive while idle
            with self._count_lock:
                self._pending -= 1
                last = self._pending == 0
            if last:
                self._done.release()

    def run(self, task: Task, stall: Stall) -> None:
        """Run ``task(i)`` for every replica ``i`` concurrently; return when all have returned.

        ``task`` must not raise (it records failures itself). ``stall`` is not called: replica
        threads wait at the rendezvous with deadlines, which report a replica that never arrives.
        """
        if self._closed:
            raise RuntimeError("the Runtime is closed")
        if self.size == 1:
            task(0)
            return
        with self.blas.shared():
            self._task = task
            self._pending = self.size - 1
            for i in range(1, self.size):
                self._go[i].release()
            try:
                task(0)
            finally:
                self._done.acquire()
                self._task = None

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._task = _STOP
        for i in range(1, len(self._threads) + 1):  # the workers started (all but after a failed start)
            self._go[i].release()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)
