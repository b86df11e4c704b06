"""Print, as one JSON line, where popdist_py says this instance stands (read from its environment)."""

import json

import popdist_py
from popdist_py.topology import read_topology

topology = read_topology()
print(json.dumps({
    "num_total_replicas": popdist_py.getNumTotalReplicas(),
    "num_local_replicas": popdist_py.getNumLocalReplicas(),
    "replica_index_offset": popdist_py.getReplicaIndexOffset(),
    "ipus_per_replica": popdist_py.getNumIpusPerReplica(),
    "num_instances": popdist_py.getNumInstances(),
    "instance_index": popdist_py.getInstanceIndex(),
    "local_instance_index": popdist_py.getLocalInstanceIndex(),
    "local_replicas": [topology.local_replicas.start, topology.local_replicas.stop],
}))
