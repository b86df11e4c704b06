"""Start and stop, where this process stands, and what this build can do (Horovod's basics).

``init`` is collective over the world (every rank calls it); it takes the world poprun,
mpiexec or srun started (``popdist_py``'s world, with its failure propagation), or an mpi4py
communicator to run on. Every query before ``init`` raises Horovod's ValueError.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Sequence
from typing import Any

from popcontract import settings
from popcontract.environment import HOROVOD_TIMELINE
from popdist_py.horovod.common import process_sets
from popdist_py.horovod.common.process_sets import ProcessSet, global_process_set, set_world_rank
from popdist_py.horovod.common.runtime import Runtime
from popdist_py.horovod.common.timeline import Timeline

NOT_INITIALIZED = process_sets.NOT_INITIALIZED
#: HOROVOD_TIMELINE's value for a timeline that start_timeline and stop_timeline write.
DYNAMIC = "DYNAMIC"

_lock = threading.RLock()
_state: _State | None = None


class _State:
    """What one ``init`` set up: the runtime and where this rank stands."""

    def __init__(self, comm: Any, process_sets: Sequence[ProcessSet]) -> None:
        from mpi4py import MPI

        ranks_of_sets = [ranks_of(ps, comm) for ps in process_sets]
        self.comm = comm
        self.runtime = Runtime(comm, ranks_of_sets)
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        self.local_rank: int = local.Get_rank()
        self.local_size: int = local.Get_size()
        cross = comm.Split(self.local_rank, comm.Get_rank())
        self.cross_rank: int = cross.Get_rank()
        self.cross_size: int = cross.Get_size()
        sizes = comm.allgather(self.local_size)
        self.homogeneous = len(set(sizes)) == 1
        local.Free()
        cross.Free()
        self.threads_supported = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        for set_id, ps in enumerate(process_sets, start=1):
            ps.process_set_id = set_id
            ps.ranks = ranks_of_sets[set_id - 1]
        global_process_set.ranks = list(range(comm.Get_size()))
        self.process_sets: dict[int, ProcessSet] = {0: global_process_set}
        self.process_sets.update({ps.process_set_id: ps for ps in process_sets if ps.process_set_id is not None})


def ranks_of(ps: ProcessSet, comm: Any) -> list[int]:
    if ps.mpi_comm is None:
        ranks = list(ps.ranks)
    else:
        from mpi4py import MPI

        group = ps.mpi_comm.Get_group()
        ranks = sorted(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), comm.Get_group()))
        group.Free()
    bad = [r for r in ranks if not 0 <= r < comm.Get_size()]
    if bad or not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"process set {ranks}: ranks must be distinct, at least one, each in 0 .. "
                         f"{comm.Get_size() - 1}")
    return ranks


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | None = None) -> None:
    """Start Horovod (collective; idempotent): ``comm`` an mpi4py communicator (or a list of world
    ranks) to run on instead of the whole world; ``process_sets`` registered as ids 1, 2, ..."""
    global _state
    with _lock:
        if _state is not None:
            return
        from popdist_py.world import world

        base = world()
        if comm is None:
            use = base
        elif isinstance(comm, (list, tuple)):
            from mpi4py import MPI

            group = base.Get_group().Incl(sorted(comm))
            use = base.Create_group(group)
            group.Free()
            if use == MPI.COMM_NULL:
                raise ValueError(f"hvd.init(comm={list(comm)}): this rank ({base.Get_rank()}) is not in it")
        else:
            use = comm
        _state = _State(use, list(process_sets or ()))
        set_world_rank(_state.comm.Get_rank())
        path = settings.text(HOROVOD_TIMELINE)
        if path and path != DYNAMIC and _state.comm.Get_rank() == 0:
            _state.runtime.timeline = Timeline(path)
        atexit.register(_shutdown_at_exit)


def _shutdown_at_exit() -> None:
    shutdown()


def shutdown() -> None:
    """Stop Horovod on this rank: its ops in flight fail, peers' ops that need it fail naming it."""
    global _state
    with _lock:
        state, _state = _state, None
        set_world_rank(None)
    if state is not None:
        state.runtime.stop()
        if state.runtime.timeline is not None:
            state.runtime.timeline.close()
        for ps in state.process_sets.values():
            if ps is not global_process_set:
                ps._invalidate()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Write a timeline of the ops to ``file_path`` from now on (rank 0 writes it); needs
    HOROVOD_TIMELINE=DYNAMIC, as Horovod's does."""
    current = state()
    if settings.text(HOROVOD_TIMELINE) != DYNAMIC:
        raise ValueError(f"start_timeline needs {HOROVOD_TIMELINE}={DYNAMIC} in the environment (set before "
                         f"hvd.init())")
    if current.comm.Get_rank() == 0:
        stop_timeline()
        current.runtime.timeline = Timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop writing the timeline (and close its file)."""
    timeline, state().runtime.timeline = state().runtime.timeline, None
    if timeline is not None:
        timeline.close()


def state() -> _State:
    """The running ``init``'s state; ValueError (Horovod's) before ``init``."""
    current = _state
    if current is None:
        raise ValueError(NOT_INITIALIZED)
    return current


def is_initialized() -> bool:
    return _state is not None


def size() -> int:
    """The number of ranks (processes) of the job."""
    value: int = state().comm.Get_size()
    return value


def rank() -> int:
    """This process's rank, 0 .. size() - 1."""
    value: int = state().comm.Get_rank()
    return value


def local_size() -> int:
    """The number of ranks on this host."""
    return state().local_size


def local_rank() -> int:
    """This process's rank among the ranks of its host."""
    return state().local_rank


def cross_size() -> int:
    """The number of ranks with this process's local rank, one per host: the number of hosts."""
    return state().cross_size


def cross_rank() -> int:
    """This host's index among the hosts (the rank among ranks with the same local rank)."""
    return state().cross_rank


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    return state().homogeneous


def mpi_threads_supported() -> bool:
    """True when MPI runs with thread level MULTIPLE (popdist_py asks for it)."""
    return state().threads_supported


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def sycl_built() -> bool:
    return False
