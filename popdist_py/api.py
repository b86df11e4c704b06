"""PopDist's query functions under their original names, so ported applications run unchanged."""

from __future__ import annotations

from popdist_py import validate
from popdist_py.topology import is_set, read_topology


def isPopdistEnvSet() -> bool:
    """True when this process is one instance of several, or was started by ``poprun``: its
    ``POPDIST_*`` variables are present, or a bare MPI launcher started N > 1 processes (which
    then run as N instances of one replica each), so that the distributed branch of a program
    is taken wherever the job is distributed."""
    return is_set() or read_topology().num_instances > 1


def getNumTotalReplicas() -> int:
    return read_topology().num_total_replicas


def getNumLocalReplicas() -> int:
    return read_topology().num_local_replicas


def getReplicaIndexOffset() -> int:
    return read_topology().replica_index_offset


def getNumIpusPerReplica() -> int:
    return read_topology().ipus_per_replica


def getNumInstances() -> int:
    return read_topology().num_instances


def getInstanceIndex() -> int:
    return read_topology().instance_index


def getLocalInstanceIndex() -> int:
    return read_topology().local_instance_index


def getDeviceId(ipusPerReplica: int = 0) -> int:
    """The id of the (virtual) device this instance attaches to: one device per instance.

    With IPUs, device ids enumerate devices of ``L x ipus`` IPUs; here the instance index plays
    that role. ``ipusPerReplica`` (when non-zero) must match the environment, as in PopDist.
    """
    if ipusPerReplica and not checkNumIpusPerReplica(ipusPerReplica):
        raise ValueError(
            f"ipusPerReplica={ipusPerReplica} does not match POPDIST_NUM_IPUS_PER_REPLICA="
            f"{getNumIpusPerReplica()}"
        )
    return read_topology().instance_index


def checkNumIpusPerReplica(n: int) -> bool:
    """False when the environment says a different number of IPUs per replica."""
    n = validate.count("number of IPUs per replica", n)
    return read_topology().ipus_per_replica == n if is_set() else True
