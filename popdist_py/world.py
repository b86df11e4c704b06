"""The MPI world of all instances, initialised lazily so that importing popdist_py stays cheap.

Instance ``i`` is rank ``i`` of ``MPI.COMM_WORLD``. mpi4py is imported (which initialises MPI,
with thread level MULTIPLE) only on the first call that needs it. The first initialisation also
installs the failure-safety hooks (``popdist_py.failsafe``), so that an instance that fails can
never leave its peers waiting forever in a collective.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType
from typing import TYPE_CHECKING

from popcontract import settings
from popcontract.environment import MPI_RANK_VARIABLES
from popcontract.settings import PopdistEnvError
from popdist_py.topology import read_topology

if TYPE_CHECKING:  # pragma: no cover
    from mpi4py import MPI as _MPI

_lock = threading.RLock()
_ready = False


def launched_by_mpi() -> bool:
    """True when an MPI launcher (mpiexec/mpirun) started this process."""
    return any(settings.text(name) for name in MPI_RANK_VARIABLES)


def is_single_instance() -> bool:
    """True when this process is a whole one-instance job, so collectives need no MPI at all.

    That is the case without an MPI launcher unless the PopDist environment asks for several
    instances (which then fails loudly in :func:`world` instead of silently running alone).
    """
    if _ready:
        return world().Get_size() == 1
    return not launched_by_mpi() and read_topology().num_instances == 1


def _MPI_module() -> ModuleType:
    """Import mpi4py's MPI module (initialising MPI), asking for thread level MULTIPLE."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    return MPI


def is_initialized() -> bool:
    """True when MPI is initialised and not yet finalised; never imports mpi4py itself."""
    MPI = sys.modules.get("mpi4py.MPI")
    return MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized()


def world() -> _MPI.Intracomm:
    """The communicator of all instances (``COMM_WORLD``); initialises MPI on the first call.

    Safe to call many times and from any thread. Not collective: nothing waits for the other
    instances. Raises :class:`PopdistEnvError` when the PopDist environment contradicts the MPI
    job (e.g. a program given ``POPDIST_*`` for 2 instances but started without ``mpiexec``),
    and :class:`RuntimeError` after :func:`popdist_py.finalize`.
    """
    global _ready
    if _ready:
        MPI = sys.modules["mpi4py.MPI"]
        if MPI.Is_finalized():
            raise RuntimeError("MPI has been finalised (popdist_py.finalize()); no more collectives are possible")
        world_comm: _MPI.Intracomm = MPI.COMM_WORLD
        return world_comm
    with _lock:
        MPI = _MPI_module()
        if MPI.Is_finalized():
            raise RuntimeError("MPI has been finalised (popdist_py.finalize()); no more collectives are possible")
        if not MPI.Is_initialized():  # mpi4py.rc.initialize was turned off by someone
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
        comm: _MPI.Intracomm = MPI.COMM_WORLD
        if not _ready:
            _check_topology(comm.Get_rank(), comm.Get_size())
            from popdist_py import failsafe

            failsafe.install()
            _ready = True
        return comm


def _check_topology(rank: int, size: int) -> None:
    topo = read_topology()
    if not topo.source:
        return
    if topo.num_instances != size:
        described = "the PopDist environment describes" if topo.is_set else f"{topo.source}'s variables describe"
        raise PopdistEnvError(
            f"{described} {topo.num_instances} instances but the MPI job has "
            f"{size} process(es): start the program with poprun (or mpiexec -n {topo.num_instances})"
        )
    if topo.instance_index != rank:
        raise PopdistEnvError(
            f"the PopDist environment says this is instance {topo.instance_index} but it is MPI rank {rank}: "
            "instances must be started in order, instance i as rank i"
        )
