"""Which executor runs a runtime's L local replicas: replica threads or cooperative greenlets.

``threads`` (:mod:`.pool`) run the replicas in parallel, which pays when the process has spare
cores (numpy releases the GIL in its kernels), but every collective then costs each waiting
replica an OS wake-up and a GIL hand-off (tens of microseconds). ``cooperative``
(:mod:`.cooperative`) runs them one at a time as greenlets on the calling thread: a collective
costs a few greenlet switches, and a replica that can never arrive is detected at once, but
replicas never compute in parallel. ``auto`` picks threads when 1 < L <= 1024
(:data:`MAX_THREADS`) and this instance has at least 2 cores to itself (the CPUs it may
run on, divided by the instances on its host: ``LOCAL_WORLD_SIZE`` from poprun, default 1),
else cooperative. With L == 1 neither is used:
the step runs directly on the calling thread.

Both executors have the interface :class:`ReplicaExecutor`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Protocol

from popcontract import settings

# The variables' names are the launcher's contract, defined once in popcontract.environment (import-free).
from popcontract.environment import ENGINE_EXECUTOR as ENV
from popcontract.environment import ENGINE_SLICE_BYTES, ENGINE_THREADS, LOCAL_WORLD_SIZE
from popdist_py import validate
from popdist_py.engine._execution.slices import MIN_SLICE_BYTES

log = logging.getLogger(__name__)

THREADS = "threads"
COOPERATIVE = "cooperative"
AUTO = "auto"
EXECUTORS = (AUTO, THREADS, COOPERATIVE)

#: One replica's share of a run: ``task(local index)``. It records its own failures and never raises.
Task = Callable[[int], None]
#: The rendezvous's :meth:`~.rendezvous.Rendezvous.stall`: fails the replicas waiting in a
#: collective that can no longer complete; True when it woke any.
Stall = Callable[[], bool]


class ReplicaExecutor(Protocol):
    """Runs a runtime's L local replicas: :class:`.pool.ReplicaPool` (threads) or
    :class:`.cooperative.CooperativePool` (greenlets)."""

    size: int

    def run(self, task: Task, stall: Stall) -> None:
        """Run ``task(i)`` for every local replica ``i``; return when all have returned.

        ``stall`` is called when no replica can run while some wait at the rendezvous (only an
        executor that can know it calls it: threads wait with deadlines instead).
        """

    def shutdown(self) -> None:
        """Release the executor's resources (idempotent)."""


#: Most local replicas the threads executor runs (one OS thread each): ``auto`` picks the
#: cooperative executor above it and ``executor="threads"`` is refused. Beyond it every
#: collective would wake over a thousand threads, and the OS limits on threads come near.
MAX_THREADS = 1024


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else all of them)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - macOS / Windows
        return os.cpu_count() or 1


def instances_on_host() -> int:
    """``LOCAL_WORLD_SIZE`` (set by poprun and torchrun); 1 when absent."""
    return settings.integer(LOCAL_WORLD_SIZE, 1, minimum=1)


def cores_per_instance() -> int:
    return available_cores() // instances_on_host()


def polls(num_local_replicas: int) -> bool:
    """Whether replica threads waiting at a collective poll before they sleep: only when each of
    the instance's replica threads has a core to itself (:data:`.rendezvous.SPIN_SECONDS`)."""
    return num_local_replicas <= cores_per_instance()


def slice_threads(requested: int | None) -> int:
    """Threads that share a large collective's local work (:mod:`.slices`): ``requested`` (an
    argument) wins over ``$POPDIST_ENGINE_THREADS``, which wins over :func:`cores_per_instance`."""
    if requested is not None:
        return validate.count("threads", requested)
    return settings.integer(ENGINE_THREADS, 0, minimum=1) or max(1, cores_per_instance())


def slice_bytes() -> int:
    """The least bytes a slice of local work is given (:class:`.slices.Slicer`):
    ``$POPDIST_ENGINE_SLICE_BYTES`` on a host where cutting pays sooner or later, else
    :data:`.slices.MIN_SLICE_BYTES`."""
    return settings.integer(ENGINE_SLICE_BYTES, MIN_SLICE_BYTES, minimum=1)


def choose(requested: str | None, num_local_replicas: int) -> str:
    """The executor to use: ``requested`` (an argument) wins over ``$POPDIST_ENGINE_EXECUTOR``,
    which wins over ``auto``; ``auto`` is resolved by the rule in this module's docstring."""
    if requested is not None:
        if requested not in EXECUTORS:
            raise ValueError(f"executor={requested!r} is not one of {', '.join(EXECUTORS)}")
        name = requested
    else:
        name = settings.choice(ENV, EXECUTORS, AUTO)
    if name != AUTO:
        return name
    cores = cores_per_instance()
    chosen = THREADS if 1 < num_local_replicas <= MAX_THREADS and cores >= 2 else COOPERATIVE
    log.debug("executor auto -> %s (L=%d, %d core(s) for this instance)", chosen, num_local_replicas, cores)
    return chosen
