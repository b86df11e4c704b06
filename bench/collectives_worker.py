"""Run under mpiexec/poprun: time collectives per size and print one JSON line (from rank 0).

    collectives_worker.py raw    OP SIZES...   mpi4py buffer calls, one array per rank
    collectives_worker.py engine OP SIZES...   popdist_py.engine, L replicas per process

OP is allreduce, allgather or reduce_scatter; SIZES are bytes per replica (float32).
Each size: warm-up, then batches of iterations; the per-call time is the median batch mean,
taken as the maximum over ranks (a collective is as slow as its slowest participant).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from mpi4py import MPI

BATCHES = 5


def iterations_for(nbytes: int) -> int:
    return max(3, min(2000, int(64 * 2**20 / max(nbytes, 1024) // 4)))


def raw(op: str, nbytes: int, comm: MPI.Intracomm) -> float:
    n = nbytes // 4
    send = np.ones(n, dtype=np.float32)
    if op == "allreduce":
        recv = np.empty_like(send)
        call = lambda: comm.Allreduce(send, recv, op=MPI.SUM)  # noqa: E731
    elif op == "allgather":
        recv = np.empty(n * comm.size, dtype=np.float32)
        call = lambda: comm.Allgather(send, recv)  # noqa: E731
    else:
        recv = np.empty(n // comm.size, dtype=np.float32)
        send = np.ones(recv.size * comm.size, dtype=np.float32)
        call = lambda: comm.Reduce_scatter_block(send, recv, op=MPI.SUM)  # noqa: E731
    iters = iterations_for(nbytes)
    call()
    means = []
    for _ in range(BATCHES):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        means.append((time.perf_counter() - start) / iters)
    return float(np.median(means))


def engine(op: str, nbytes: int, comm: MPI.Intracomm) -> float:
    from popdist_py.engine import ops

    rt = _runtime()
    n = nbytes // 4
    data = np.ones((rt.instance_replication_factor, n), dtype=np.float32)
    iters = iterations_for(nbytes)
    call = {"allreduce": lambda x: ops.replicated_all_reduce(x, op="add"),
            "allgather": lambda x: ops.replicated_all_gather(x),
            "reduce_scatter": lambda x: ops.replicated_reduce_scatter(x, op="add")}[op]

    def step(ctx, x, count):
        for _ in range(int(count)):
            call(x)

    counts = np.full(rt.instance_replication_factor, iters)
    rt.run(step, data, np.ones_like(counts))
    means = []
    for _ in range(BATCHES):
        comm.Barrier()
        start = time.perf_counter()
        rt.run(step, data, counts)
        means.append((time.perf_counter() - start) / iters)
    return float(np.median(means))


_RT = None


def _runtime():
    global _RT
    if _RT is None:
        from popdist_py.engine import Runtime

        _RT = Runtime()
    return _RT


def main() -> None:
    mode, op, sizes = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3:]]
    comm = MPI.COMM_WORLD
    measure = raw if mode == "raw" else engine
    results = {}
    for nbytes in sizes:
        local = measure(op, nbytes, comm)
        results[nbytes] = comm.allreduce(local, op=MPI.MAX)
    if comm.rank == 0:
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
