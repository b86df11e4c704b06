"""PopDist for poprun-py: where this instance stands, host collectives, dataset sharding.

Importing is cheap: MPI is initialised only by ``init()`` or the first call that needs it.
"""

from typing import Any

from popcontract import __version__ as __version__  # the distribution's one version
from popcontract.compiled import MissingPart
from popcontract.settings import PopdistEnvError
from popdist_py import failsafe as _failsafe  # noqa: F401  (registers its exit handler early)
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
from popdist_py.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError

#: Names loaded on first use, so that importing popdist_py imports neither mpi4py nor numpy.
_LAZY = {
    "init": "popdist_py.lifecycle",
    "finalize": "popdist_py.lifecycle",
    "initializeBackend": ("popdist_py.lifecycle", "init"),
    "finalizeBackend": ("popdist_py.lifecycle", "finalize"),
    "isBackendInitialized": ("popdist_py.lifecycle", "is_backend_initialized"),
    "synchronize": "popdist_py.host_collectives",
    "allreduce": "popdist_py.host_collectives",
    "allgather": "popdist_py.host_collectives",
    "broadcast": "popdist_py.host_collectives",
    "barrier": "popdist_py.host_collectives",
    "execute_on_instances": "popdist_py.instances",
}


def __getattr__(name: str) -> Any:  # PEP 562
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'popdist_py' has no attribute {name!r}")
    module_name, attr = target if isinstance(target, tuple) else (target, name)
    import importlib

    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "MissingPart",
    "PopdistEnvError",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "checkNumIpusPerReplica",
    "execute_on_instances",
    "finalize",
    "finalizeBackend",
    "getDeviceId",
    "getInstanceIndex",
    "getLocalInstanceIndex",
    "getNumInstances",
    "getNumIpusPerReplica",
    "getNumLocalReplicas",
    "getNumTotalReplicas",
    "getReplicaIndexOffset",
    "init",
    "initializeBackend",
    "isBackendInitialized",
    "isPopdistEnvSet",
    "synchronize",
]
