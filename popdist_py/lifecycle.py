"""PopDist's ``init()`` / ``finalize()``: explicit start and end of the MPI part of an instance.

Neither is required (MPI starts with the first collective and ends at exit), but ``init()`` at
start-up makes every later timeout name the late instance, and installs failure propagation
before any user code can fail.
"""

from __future__ import annotations

import logging
import sys

from popdist_py import agreement
from popdist_py.world import is_initialized, is_single_instance, world

log = logging.getLogger(__name__)


def init(*, timeout: float | None = None) -> None:
    """Initialise MPI and failure propagation; collective over all instances (call it on each).

    Waits (at most ``timeout`` seconds, default ``POPDIST_COLLECTIVE_TIMEOUT``) until every
    instance has called it. Idempotent. In a one-instance job it does nothing: no MPI is needed.
    """
    if is_single_instance() and not is_initialized():
        return
    comm = world()
    agreement.prepare(comm, timeout=timeout, what="init")
    log.debug("instance %d of %d initialised", comm.Get_rank(), comm.Get_size())


def finalize() -> None:
    """Finalise MPI now (collective, like MPI_Finalize); later collectives raise RuntimeError."""
    if is_initialized():
        sys.modules["mpi4py.MPI"].Finalize()


def is_backend_initialized() -> bool:
    """PopDist's ``isBackendInitialized``: MPI is up and not yet finalised."""
    return is_initialized()
