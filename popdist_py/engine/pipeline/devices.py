"""A replica's devices on a CPU: one worker thread per (local replica, device), each on a core of
its own where the process has enough (CPU affinity), so ``--num-replicas R --ipus-per-replica K``
really uses ``R x K`` cores. numpy releases the GIL in its kernels, so the devices of a pipeline
compute at once.

Cores: this instance's share of its affinity mask (``LOCAL_WORLD_SIZE`` instances on the host,
this one ``LOCAL_RANK``); with at least ``L x K`` cores in it, worker ``(i, d)`` is pinned to core
``i * K + d`` of the share; with fewer, nothing is pinned (the OS spreads the threads) and
:attr:`Devices.pinned` says so.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from popcontract import settings
from popcontract.environment import LOCAL_RANK
from popdist_py.engine._execution.executor import available_cores, instances_on_host

log = logging.getLogger(__name__)
T = TypeVar("T")


def core_share(workers: int) -> list[int] | None:
    """The cores to pin ``workers`` threads to, one each, or None when this instance has too few."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - no affinity on this OS
        return None
    here = instances_on_host()
    rank = settings.integer(LOCAL_RANK, 0)
    share = len(cores) // here if here > 1 else len(cores)
    mine = cores[rank * share:(rank + 1) * share] if 0 <= rank < here else []
    return mine[:workers] if len(mine) >= workers else None


def _pin(core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})  # 0: the calling thread


class Devices:
    """Worker threads for ``replicas`` local replicas x ``per_replica`` devices, started on first use."""

    def __init__(self, replicas: int, per_replica: int) -> None:
        self.replicas = replicas
        self.per_replica = per_replica
        self.cores = core_share(replicas * per_replica)
        #: whether each worker runs on a core of its own
        self.pinned = self.cores is not None
        self._pools: dict[tuple[int, int], ThreadPoolExecutor] = {}
        self._finalizer = weakref.finalize(self, _shutdown, self._pools)
        if not self.pinned:
            log.debug("pipeline devices: %d workers, %d core(s) available: not pinned", replicas * per_replica,
                      available_cores())

    def core(self, replica: int, device: int) -> int | None:
        """The core of worker ``(replica, device)``; None for a negative device (the host thread: unpinned)."""
        return None if self.cores is None or device < 0 else self.cores[replica * self.per_replica + device]

    def submit(self, replica: int, device: int, job: Callable[[], T]) -> Future[T]:
        """Run ``job`` on device ``device`` of local replica ``replica`` (its jobs run one at a time)."""
        key = (replica, device)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = ThreadPoolExecutor(1, thread_name_prefix=f"replica{replica}-device{device}",
                                                         initializer=_pin, initargs=(self.core(replica, device),))
        return pool.submit(job)

    def close(self) -> None:
        """Stop the workers (after the jobs they are running). Idempotent."""
        self._finalizer()


def _shutdown(pools: dict[Any, ThreadPoolExecutor]) -> None:
    for pool in pools.values():
        pool.shutdown(wait=True)
    pools.clear()


__all__ = ["Devices", "core_share"]
