"""``multihost``: on the network-namespace cluster of the tests (``tests/cluster.py``, root only),
poprun starting 2 instances on 2 hosts against bare ``mpiexec -hosts`` on the same hosts, and the
engine's 16 MiB all-reduce across the hosts over TCP against raw MPI over TCP in the same job
(batches alternating, as in ``allreduce``).

Bare mpiexec needs ``-localhost`` too: without it the remote proxies call back on this machine's
name, which resolves to loopback here. MPI is kept on TCP (``NETWORK_ENV``) in both.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.collectives import WORKER, _entry, worker_times
from bench.timing import time_commands
from tests.cluster import NETWORK_ENV, Cluster, unavailable_reason

BIN = Path(sys.executable).parent
log = logging.getLogger(__name__)
SIZE = 16 << 20


def run(quick: bool) -> dict[str, object]:
    reason = unavailable_reason()
    if reason:
        log.warning("multihost: not measured: %s", reason)
        return {"skipped": reason}
    with network_env(), Cluster(2) as cluster:
        return _measure(cluster, quick)


@contextmanager
def network_env() -> Iterator[None]:
    """Within, MPI is kept on TCP (``NETWORK_ENV`` in this process's environment); restored after."""
    saved = {name: os.environ.get(name) for name in NETWORK_ENV}
    os.environ.update(NETWORK_ENV)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _measure(cluster: Cluster, quick: bool) -> dict[str, object]:
    python = sys.executable
    program = [python, "-c", "from mpi4py import MPI"]
    hosts = ",".join(cluster.names)
    times = time_commands({
        "mpiexec": [str(BIN / "mpiexec"), "-hosts", ",".join(f"{h}:1" for h in cluster.names),
                    "-localhost", cluster.bridge_addresses[0], "-n", "2", *program],
        "poprun": [str(BIN / "poprun"), "--num-instances", "2", "-H", hosts, *program],
    }, rounds=5 if quick else 15)
    launch_ratio = times["poprun"]["median"] / times["mpiexec"]["median"]
    both = worker_times([str(BIN / "poprun"), "--num-instances", "2", "--num-replicas", "4", "-H", hosts,
                 python, *WORKER, "engine+raw", "allreduce", str(SIZE)])[SIZE]
    return {
        "hosts": cluster.names, "transport": NETWORK_ENV["UCX_TLS"],
        "launch": {"seconds": times, "ratio": launch_ratio},
        "allreduce": {"bytes_per_replica": SIZE, "engine_2x2": _entry("allreduce", SIZE, both["engine"], 4),
                      "mpi4py_raw_2": _entry("allreduce", SIZE, both["raw"], 2),
                      "ratio_engine_to_raw_2": both["engine"] / both["raw"]},
    }
