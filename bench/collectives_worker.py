"""Run under mpiexec/poprun: time collectives per size and print one JSON line (from rank 0).

    collectives_worker.py KINDS OP SIZES...

KINDS joins with ``+`` one or more of: ``raw`` (mpi4py buffer calls on COMM_WORLD, one array per
rank), ``engine`` (popdist_py.engine, L replicas per process, the executor its ``auto`` choice),
``threads`` and ``cooperative`` (the engine with that executor), and ``gloo`` (torch.distributed's
gloo backend, one tensor per rank, set up from the torchrun variables poprun gives). OP is
allreduce, allgather, reduce_scatter or broadcast (not ``engine``: it has no broadcast, as PopXL
has none); SIZES are bytes per replica (float32). Each size: warm-up, then batches of
iterations; a time is the median batch mean, taken as the maximum over ranks (a collective is as
slow as its slowest participant). The kinds' batches alternate, so all see the same machine:
this machine's speed drifts by tens of percent over seconds, which separate jobs would turn into
ratio noise. Prints ``{size: {kind: seconds}}``.
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
    elif op == "broadcast":
        call = lambda: comm.Bcast(send, root=0)  # noqa: E731
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


def engine_batch(op: str, nbytes: int, comm: MPI.Intracomm, iters: int, executor: str | None = None
                 ) -> Callable[[], None]:
    from popdist_py.engine import ops

    rt = _runtime(executor)
    data = np.ones((rt.instance_replication_factor, nbytes // 4), dtype=np.float32)
    call: Callable[[np.ndarray], object] = {"allreduce": lambda x: ops.replicated_all_reduce(x, op="add"),
            "allgather": lambda x: ops.replicated_all_gather(x),
            "reduce_scatter": lambda x: ops.replicated_reduce_scatter(x, op="add")}[op]

    def step(ctx: StepContext, x: np.ndarray, count: np.ndarray) -> None:
        for _ in range(int(count)):
            call(x)

    counts = np.full(rt.instance_replication_factor, iters)
    return lambda: rt.run(step, data, counts)


def gloo_batch(op: str, nbytes: int, iters: int) -> Callable[[], None]:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: poprun's
    size = dist.get_world_size()
    n = nbytes // 4
    send = torch.ones(n, dtype=torch.float32)
    call: Callable[[], object]
    if op == "allreduce":
        call = lambda: dist.all_reduce(send)  # noqa: E731
    elif op == "broadcast":
        call = lambda: dist.broadcast(send, src=0)  # noqa: E731
    elif op == "allgather":
        gathered = torch.empty(n * size, dtype=torch.float32)
        call = lambda: dist.all_gather_into_tensor(gathered, send)  # noqa: E731
    else:
        part = torch.empty(n // size, dtype=torch.float32)
        whole = torch.ones(part.numel() * size, dtype=torch.float32)
        call = lambda: dist.reduce_scatter_single(part, whole)  # noqa: E731

    def batch() -> None:
        for _ in range(iters):
            call()

    return batch


_RUNTIMES: dict[str | None, Runtime] = {}


def _runtime(executor: str | None = None) -> Runtime:
    """The job's runtime with ``executor`` (None: the runtime's own choice), one of each, reused."""
    rt = _RUNTIMES.get(executor)
    if rt is None:
        from popdist_py.engine import Runtime

        rt = _RUNTIMES[executor] = Runtime(executor=executor)
    return rt


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


KINDS = ("engine", "threads", "cooperative", "raw", "gloo")


def _batch(kind: str, op: str, nbytes: int, comm: MPI.Intracomm, iters: int) -> Callable[[], None]:
    if kind == "engine":
        return engine_batch(op, nbytes, comm, iters)
    if kind in ("threads", "cooperative"):
        return engine_batch(op, nbytes, comm, iters, executor=kind)
    if kind == "raw":
        return raw_batch(op, nbytes, comm, iters)
    return gloo_batch(op, nbytes, iters)


def main() -> None:
    mode, op, sizes = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3:]]
    kinds = mode.split("+")
    if not kinds or any(kind not in KINDS for kind in kinds):
        raise SystemExit(f"mode {mode!r} is not one or more of {', '.join(KINDS)} joined by '+'")
    if op == "broadcast" and {"engine", "threads", "cooperative"} & set(kinds):
        raise SystemExit("the engine has no broadcast (as PopXL has none): time it as raw or gloo")
    comm = MPI.COMM_WORLD
    results = {}
    for nbytes in sizes:
        iters = iterations_for(nbytes)
        batches = {kind: _batch(kind, op, nbytes, comm, iters) for kind in kinds}
        local = measure(batches, iters, comm)
        results[nbytes] = {name: comm.allreduce(t, op=MPI.MAX) for name, t in local.items()}
    if comm.rank == 0:
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
