"""Where the R global replicas run: L per instance, and which instance this process is.

Resolved once, when a Runtime is built, from its arguments and the PopDist environment that
``poprun`` sets (:func:`popdist_py.topology.read_topology`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from popdist_py import validate
from popdist_py.topology import read_topology


@dataclass(frozen=True)
class ReplicaPlacement:
    """The R global replicas placed on instances, ``num_local_replicas`` each (replica ``r`` runs on
    instance ``r // num_local_replicas``); this process is instance ``instance``."""

    replication_factor: int
    num_local_replicas: int
    instance: int = 0

    @property
    def num_instances(self) -> int:
        return self.replication_factor // self.num_local_replicas

    @property
    def replica_index_offset(self) -> int:
        """Global index of this instance's first replica."""
        return self.instance * self.num_local_replicas

    def owner(self, replica: int) -> int:
        """The instance that runs global replica ``replica``."""
        return replica // self.num_local_replicas

    def describe_instance(self, instance: int) -> str:
        lo = instance * self.num_local_replicas
        hi = lo + self.num_local_replicas - 1
        return f"instance {instance} (replica {lo})" if lo == hi else f"instance {instance} (replicas {lo}-{hi})"

    def describe_replica(self, replica: int) -> str:
        if self.num_instances == 1:
            return f"replica {replica}"
        return f"replica {replica} (instance {self.owner(replica)})"

    def describe_replicas(self, replicas: Sequence[int]) -> str:
        rs = sorted(replicas)
        word = "replica" if len(rs) == 1 else "replicas"
        text = f"{word} {', '.join(map(str, rs))}"
        if self.num_instances > 1:
            insts = sorted({self.owner(r) for r in rs})
            text += f" (instance{'s' if len(insts) > 1 else ''} {', '.join(map(str, insts))})"
        return text


def runtime_topology(replication: int | None, comm: Any) -> tuple[int, int, int, Any]:
    """(R, L, instance index, communicator or None) from the arguments and the PopDist environment."""
    topo = read_topology()
    if comm is not None:
        size, rank = comm.Get_size(), comm.Get_rank()
        if replication is None:
            if topo.is_set:
                if (topo.num_instances, topo.instance_index) != (size, rank):
                    raise ValueError(
                        f"the PopDist environment describes instance {topo.instance_index} of {topo.num_instances} "
                        f"but the given communicator makes this rank {rank} of {size}"
                    )
                return topo.num_total_replicas, topo.num_local_replicas, rank, comm
            return size, 1, rank, comm
        r = validate.count("replication", replication)
        if r % size:
            raise ValueError(
                f"replication={r} cannot be split evenly over the communicator's {size} instances "
                f"(use a multiple of {size})"
            )
        return r, _local(r // size, f"replication={r} over {size} instances"), rank, comm
    if replication is None:
        if topo.num_instances > 1:
            from popdist_py.world import world

            comm = world()
        return topo.num_total_replicas, topo.num_local_replicas, topo.instance_index, comm
    r = validate.count("replication", replication)
    if topo.is_set and topo.num_instances > 1:
        raise ValueError(
            f"Runtime(replication={r}) contradicts the PopDist environment, which runs "
            f"{topo.num_total_replicas} replicas as {topo.num_instances} instances of {topo.num_local_replicas} "
            f"(POPDIST_NUM_TOTAL_REPLICAS={topo.num_total_replicas}, POPDIST_NUM_LOCAL_REPLICAS="
            f"{topo.num_local_replicas}): use Runtime() to take the replication from poprun"
        )
    return r, _local(r, f"replication={r}"), 0, None


#: Most replicas one process (instance) runs: poprun's own limit on --num-replicas.
MAX_LOCAL_REPLICAS = 65536


def _local(L: int, what: str) -> int:
    if L > MAX_LOCAL_REPLICAS:
        raise ValueError(
            f"{what} makes {L} replicas in one process, more than {MAX_LOCAL_REPLICAS}: "
            "use fewer replicas or more instances"
        )
    return L


__all__ = ["ReplicaPlacement", "runtime_topology"]
