"""Run under mpiexec/poprun: time collectives per size and print one JSON line (from rank 0).

    collectives_worker.py raw        OP SIZES...   mpi4py buffer calls on COMM_WORLD, one array per rank
    collectives_worker.py engine     OP SIZES...   popdist_py.engine, L replicas per process
    collectives_worker.py engine+raw OP SIZES...   both, batch by batch in the same processes

OP is allreduce, allgather or reduce_scatter; SIZES are bytes per replica (float32). Each size:
warm-up, then batches of iterations; a time is the median batch mean, taken as the maximum over
ranks (a collective is as slow as its slowest participant). With ``engine+raw`` the engine's
batches alternate with raw batches, so both see the same machine: this machine's speed drifts
by tens of percent over seconds, which separate jobs would turn into ratio noise. Prints
``{size: {kind: seconds}}`` with kinds ``engine`` and/or ``raw``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

if TYPE_CHECKING:
    from popdist_py.engine import Runtime, StepContext

BATCHES = 7


def iterations_for(nbytes: int) -> int:
    return max(3, min(1000, int(32 * 2**20 / max(nbytes, 1024) // 4)))


def raw_batch(op: str, nbytes: int, comm: MPI.Intracomm, iters: int) -> Callable[[], None]:
    n = nbytes // 4
    send = np.ones(n, dtype=np.float32)
    call: Callable[[], object]
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

    def batch() -> None:
        for _ in range(iters):
            call()

    return batch


def engine_batch(op: str, nbytes: int, comm: MPI.Intracomm, iters: int) -> Callable[[], None]:
    from popdist_py.engine import ops

    rt = _runtime()
    data = np.ones((rt.instance_replication_factor, nbytes // 4), dtype=np.float32)
    call: Callable[[np.ndarray], object] = {"allreduce": lambda x: ops.replicated_all_reduce(x, op="add"),
            "allgather": lambda x: ops.replicated_all_gather(x),
            "reduce_scatter": lambda x: ops.replicated_reduce_scatter(x, op="add")}[op]

    def step(ctx: StepContext, x: np.ndarray, count: np.ndarray) -> None:
        for _ in range(int(count)):
            call(x)

    counts = np.full(rt.instance_replication_factor, iters)
    return lambda: rt.run(step, data, counts)


_RT: Runtime | None = None


def _runtime() -> Runtime:
    global _RT
    if _RT is None:
        from popdist_py.engine import Runtime

        _RT = Runtime()
    return _RT


def measure(batches: dict[str, Callable[[], None]], iters: int, comm: MPI.Intracomm) -> dict[str, float]:
    """Median seconds per call of each kind, batches of the kinds alternating."""
    for batch in batches.values():  # warm-up: plans, buffers, MPI connections
        batch()
    means: dict[str, list[float]] = {name: [] for name in batches}
    for _ in range(BATCHES):
        for name, batch in batches.items():
            comm.Barrier()
            start = time.perf_counter()
            batch()
            means[name].append((time.perf_counter() - start) / iters)
    return {name: float(np.median(m)) for name, m in means.items()}


def main() -> None:
    mode, op, sizes = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3:]]
    comm = MPI.COMM_WORLD
    results = {}
    for nbytes in sizes:
        iters = iterations_for(nbytes)
        batches = {}
        if mode in ("engine", "engine+raw"):
            batches["engine"] = engine_batch(op, nbytes, comm, iters)
        if mode in ("raw", "engine+raw"):
            batches["raw"] = raw_batch(op, nbytes, comm, iters)
        if not batches:
            raise SystemExit(f"mode {mode!r} is not one of raw, engine, engine+raw")
        local = measure(batches, iters, comm)
        results[nbytes] = {name: comm.allreduce(t, op=MPI.MAX) for name, t in local.items()}
    if comm.rank == 0:
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
