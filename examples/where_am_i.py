"""Each instance says where it stands: the PopDist view poprun gives it.

Run: poprun --num-instances 2 --num-replicas 4 python examples/where_am_i.py
"""

import socket

import popdist_py as popdist


def main() -> None:
    index = popdist.getInstanceIndex()
    offset = popdist.getReplicaIndexOffset()
    local = popdist.getNumLocalReplicas()
    replicas = ", ".join(str(offset + r) for r in range(local))
    print(
        f"instance {index} of {popdist.getNumInstances()} on {socket.gethostname()}: "
        f"{local} local replica(s) of {popdist.getNumTotalReplicas()} -> global replicas {replicas}"
    )


if __name__ == "__main__":
    main()
