"""Where this instance stands, read from the ``POPDIST_*`` environment that ``poprun`` sets.

Started by a bare MPI launcher instead (``mpiexec -n N``, ``srun``), the answers are those of N
instances with one replica each, read from the launcher's own variables and said once on
stderr, so that the PopDist functions never describe 1 instance beside an N-process MPI world.
Without either, every answer is the one of a single instance with one replica. Values are
validated on every read (they are cheap to parse), so a malformed environment is reported with
the variable's name and value instead of producing a wrong topology.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

# The names are the contract between poprun and popdist_py, defined once in popcontract.environment;
# every value is read by popcontract.settings (None: this process's environment).
from popcontract.environment import (
    INSTANCE_INDEX,
    LOCAL_INSTANCE_INDEX,
    MPI_LAUNCHERS,
    NUM_INSTANCES,
    NUM_IPUS_PER_REPLICA,
    NUM_LOCAL_REPLICAS,
    NUM_TOTAL_REPLICAS,
    REPLICA_INDEX_OFFSET,
    REQUIRED,
    SLURM_LOCALID,
    UNIFORM_REPLICAS,
)
from popcontract.settings import PopdistEnvError, flag, integer, text


@dataclass(frozen=True)
class Topology:
    num_total_replicas: int = 1
    num_local_replicas: int = 1
    ipus_per_replica: int = 1
    replica_index_offset: int = 0
    local_instance_index: int = 0
    is_set: bool = False
    #: Who described it: "poprun", an MPI launcher's name (a bare ``mpiexec``), or "" (alone).
    source: str = ""

    @property
    def num_instances(self) -> int:
        return self.num_total_replicas // self.num_local_replicas

    @property
    def instance_index(self) -> int:
        return self.replica_index_offset // self.num_local_replicas

    @property
    def local_replicas(self) -> range:
        """The global indices of this instance's replicas."""
        return range(self.replica_index_offset, self.replica_index_offset + self.num_local_replicas)


def is_set(env: Mapping[str, str] | None = None) -> bool:
    """True when ``poprun`` started this process (its ``POPDIST_*`` variables are present)."""
    return any(text(name, env=env) for name in REQUIRED)


_announced = False


def launcher_topology(env: Mapping[str, str] | None = None) -> Topology | None:
    """N instances of one replica each, from the variables of the MPI launcher that started this
    process without poprun; None when none did. Rank 0 of this process's launch (``env`` None)
    says so once on stderr."""
    global _announced
    for launcher, rank_name, size_name, local_name in MPI_LAUNCHERS:
        if text(rank_name, env=env) and text(size_name, env=env):
            size = integer(size_name, 1, 1, env)
            rank = integer(rank_name, 0, 0, env)
            if rank >= size:
                raise PopdistEnvError(f"{rank_name}={rank} is not below {size_name}={size}")
            local = integer(local_name, integer(SLURM_LOCALID, 0, 0, env), 0, env)  # srun --mpi=pmi2: PMI_* and Slurm's
            topo = Topology(num_total_replicas=size, replica_index_offset=rank, local_instance_index=local,
                            source=launcher)
            if not _announced and rank == 0 and size > 1 and env is None:
                _announced = True
                logging.getLogger("popdist_py").warning(
                    "popdist_py: started by %s without poprun (%s=%d): %d instances of one replica each; "
                    "poprun sets the replicas per instance", launcher, size_name, size, size)
            return topo
    return None


def read_topology(env: Mapping[str, str] | None = None) -> Topology:
    """Parse and cross-check the PopDist environment (this process's by default), or the MPI
    launcher's when poprun did not start this process."""
    if not is_set(env):
        return launcher_topology(env) or Topology()
    missing = [name for name in REQUIRED if not text(name, env=env)]
    if missing:
        present = [f"{n}={text(n, env=env)!r}" for n in REQUIRED if text(n, env=env)]
        verb = "is" if len(present) == 1 else "are"
        raise PopdistEnvError(f"incomplete PopDist environment: {', '.join(missing)} missing while "
                              f"{', '.join(present)} {verb} set")
    total = integer(NUM_TOTAL_REPLICAS, 1, 1, env)
    local = integer(NUM_LOCAL_REPLICAS, 1, 1, env)
    offset = integer(REPLICA_INDEX_OFFSET, 0, 0, env)
    topo = Topology(
        num_total_replicas=total,
        num_local_replicas=local,
        ipus_per_replica=integer(NUM_IPUS_PER_REPLICA, 1, 1, env),
        replica_index_offset=offset,
        local_instance_index=integer(LOCAL_INSTANCE_INDEX, 0, 0, env),
        is_set=True,
        source="poprun",
    )
    if local > total:
        raise PopdistEnvError(f"{NUM_LOCAL_REPLICAS}={local} exceeds {NUM_TOTAL_REPLICAS}={total}")
    if total % local:
        raise PopdistEnvError(f"{NUM_TOTAL_REPLICAS}={total} is not a multiple of {NUM_LOCAL_REPLICAS}={local}")
    if offset % local:
        raise PopdistEnvError(f"{REPLICA_INDEX_OFFSET}={offset} is not a multiple of {NUM_LOCAL_REPLICAS}={local}")
    if offset + local > total:
        raise PopdistEnvError(
            f"{REPLICA_INDEX_OFFSET}={offset} + {NUM_LOCAL_REPLICAS}={local} exceeds {NUM_TOTAL_REPLICAS}={total}"
        )
    flag(UNIFORM_REPLICAS, True, env)  # checked only: the counts above say whether they are uniform
    for name, derived in ((NUM_INSTANCES, topo.num_instances), (INSTANCE_INDEX, topo.instance_index)):
        given = integer(name, derived, 0, env)
        if given != derived:
            raise PopdistEnvError(
                f"{name}={given} contradicts the replica counts, which give {derived} "
                f"({NUM_TOTAL_REPLICAS}={total}, {NUM_LOCAL_REPLICAS}={local}, {REPLICA_INDEX_OFFSET}={offset})"
            )
    return topo
