"""PopDist for poprun-py: where this instance stands, host collectives, dataset sharding.

Importing is cheap: MPI is initialised only by ``init()`` or the first call that needs it.
"""

from popdist_py.api import (
    checkNumIpusPerReplica,
    getDeviceId,
    getInstanceIndex,
    getLocalInstanceIndex,
    getNumInstances,
    getNumIpusPerReplica,
    getNumLocalReplicas,
    getNumTotalReplicas,
    getReplicaIndexOffset,
    isPopdistEnvSet,
)
from popdist_py.env import PopdistEnvError

__all__ = [
    "PopdistEnvError",
    "checkNumIpusPerReplica",
    "getDeviceId",
    "getInstanceIndex",
    "getLocalInstanceIndex",
    "getNumInstances",
    "getNumIpusPerReplica",
    "getNumLocalReplicas",
    "getNumTotalReplicas",
    "getReplicaIndexOffset",
    "isPopdistEnvSet",
]
