"""Run under poprun (2 instances): Horovod's API (``popdist_py.horovod.torch``) against what it
stands in for, in the same processes, their repetitions alternating; rank 0 prints one JSON line.

    horovod_worker.py training WARMUP STEPS    DistributedOptimizer against torch DDP (gloo)
    horovod_worker.py allreduce SIZES...       hvd.allreduce against mpi4py's Allreduce

``training``: two copies of one MLP (same initial weights, same batches per rank, SGD with
momentum, one torch thread per process), one wrapped by ``hvd.DistributedOptimizer``, the other
by ``DistributedDataParallel`` over gloo (set up from the torchrun variables poprun gives, on
loopback). After WARMUP steps of each, STEPS rounds each step both once, the order swapping
round by round; a step starts at a barrier and takes the slowest rank's time. Both then hold the
same training: their parameters must agree within float tolerance (the averages differ only in
rounding: DDP divides before summing, Horovod after), or the worker fails. Prints
``{"seconds": {"horovod": [...], "ddp": [...]}, "max_abs_difference": ..., ...}``.

``allreduce``: per size (bytes, float32), ``hvd.allreduce(tensor, op=hvd.Sum)`` (synchronous, a
new tensor) and ``comm.Allreduce(send, recv, op=MPI.SUM)`` on numpy arrays, and beside them
``hvd.allreduce_`` (in place: Horovod's cost without the new tensor's), batches alternating
(``bench.collectives_worker.measure``); the sums checked. Prints ``{size: {kind: seconds}}``.
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import popdist_py.horovod.torch as hvd

#: An MNIST-sized MLP: 784-1024-512-10 with biases, 1.33 M parameters (5.3 MB of gradients).
LAYERS = (784, 1024, 512, 10)
BATCH_PER_RANK = 128
#: Distinct batches per rank, taken in turn.
BATCHES = 8
LEARNING_RATE, MOMENTUM = 0.05, 0.9
#: How far apart the two models' parameters may end (float32 rounding over the steps).
RTOL, ATOL = 1e-4, 1e-5


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for n_in, n_out in itertools.pairwise(LAYERS):
        layers += [torch.nn.Linear(n_in, n_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1 + rank)
    return [(torch.randn(BATCH_PER_RANK, LAYERS[0], generator=generator),
             torch.randint(0, LAYERS[-1], (BATCH_PER_RANK,), generator=generator)) for _ in range(BATCHES)]


def _stepper(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    taken = itertools.count()

    def step() -> None:
        x, y = batches[next(taken) % len(batches)]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    return step


def training(warmup: int, steps: int, comm: Any) -> dict[str, Any]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")  # RANK, WORLD_SIZE, MASTER_ADDR/PORT: poprun's
    batches = _batches(hvd.rank())
    ours = _model()
    hvd.broadcast_parameters(ours.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM),
                                         named_parameters=ours.named_parameters())
    theirs = torch.nn.parallel.DistributedDataParallel(_model())
    steppers = {"horovod": _stepper(ours, optimizer, batches),
                "ddp": _stepper(theirs, torch.optim.SGD(theirs.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM),
                                batches)}
    for _ in range(warmup):
        for step in steppers.values():
            step()
    seconds: dict[str, list[float]] = {name: [] for name in steppers}
    names = list(steppers)
    for r in range(steps):
        for name in names[r % 2:] + names[:r % 2]:
            comm.Barrier()
            start = time.perf_counter()
            steppers[name]()
            seconds[name].append(time.perf_counter() - start)
    worst = {name: np.max(comm.allgather(values), axis=0).tolist() for name, values in seconds.items()}
    agreement = _agreement(ours, theirs.module, comm)
    dist.destroy_process_group()
    model = "-".join(map(str, LAYERS))
    return {"model": (f"MLP {model} with biases ({sum(p.numel() for p in ours.parameters()):,} parameters), "
                      f"float32, SGD with momentum {MOMENTUM}, batch {BATCH_PER_RANK} per process, one torch thread "
                      "per process"),
            "seconds": worst, **agreement, "steps": warmup + steps}


def _agreement(ours: torch.nn.Module, theirs: torch.nn.Module, comm: Any) -> dict[str, float]:
    """How far the two models' parameters ended apart (failing beyond tolerance), and how far
    training moved them from their initial values (that it did train)."""
    from mpi4py import MPI

    with torch.no_grad():
        pairs = list(zip(ours.parameters(), theirs.parameters(), strict=True))
        difference = max(float((a - b).abs().max()) for a, b in pairs)
        moved = max(float((a - p0).abs().max()) for (a, _), p0 in zip(pairs, _model().parameters(), strict=True))
        agree = all(torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in pairs)
    if not comm.allreduce(agree, op=MPI.LAND):
        raise SystemExit(f"DistributedOptimizer and DDP trained apart: parameters differ by up to {difference:g}")
    return {"max_abs_difference": comm.allreduce(difference, op=MPI.MAX),
            "max_abs_change": comm.allreduce(moved, op=MPI.MAX), "rtol": RTOL, "atol": ATOL}


def allreduce(sizes: list[int], comm: Any) -> dict[int, dict[str, float]]:
    from mpi4py import MPI

    from bench.collectives_worker import iterations_for, measure

    results = {}
    for nbytes in sizes:
        n = nbytes // 4
        tensor, zeros = torch.ones(n), torch.zeros(n)  # zeros: in place, a sum that stays put
        send, recv = np.ones(n, np.float32), np.empty(n, np.float32)
        comm.Allreduce(send, recv, op=MPI.SUM)
        if not (torch.all(hvd.allreduce(tensor, op=hvd.Sum) == comm.size) and np.all(recv == comm.size)):
            raise SystemExit(f"an all-reduce of {nbytes} bytes gave a wrong sum")
        iters = iterations_for(nbytes)
        local = measure({"horovod": _repeat(functools.partial(hvd.allreduce, tensor, op=hvd.Sum), iters),
                         "horovod_in_place": _repeat(functools.partial(hvd.allreduce_, zeros, op=hvd.Sum), iters),
                         "mpi4py": _repeat(functools.partial(comm.Allreduce, send, recv, op=MPI.SUM), iters)},
                        iters, comm)
        results[nbytes] = {name: comm.allreduce(t, op=MPI.MAX) for name, t in local.items()}
    return results


def _repeat(call: Callable[[], object], times: int) -> Callable[[], None]:
    def batch() -> None:
        for _ in range(times):
            call()

    return batch


def main() -> None:
    mode, args = sys.argv[1], [int(a) for a in sys.argv[2:]]
    if mode not in ("training", "allreduce"):
        raise SystemExit(f"mode {mode!r} is not one of training, allreduce")
    hvd.init()  # first: popdist_py's world initialises MPI (thread level MULTIPLE)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    result = training(args[0], args[1], comm) if mode == "training" else allreduce(args, comm)
    if comm.rank == 0:
        print(json.dumps(result), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
