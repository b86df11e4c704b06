"""``peers``: this project against what its users would pick instead, torch 2.13.0 (CPU): the
shuffled DistributedSampler and the launcher (poprun against torchrun and bare mpiexec).

Each comparison runs its contenders in turn, round after round, so the machine's drift hits all
of them alike; a figure is the median over rounds.

- ``sampler``: ``popdist_py.data.DistributedSampler`` against ``torch.utils.data.DistributedSampler``,
  shuffled, 2 replicas, one epoch's indices of replica 0 as a list (the work an epoch starts
  with); the two lists are asserted identical.
- ``launch``: 2 instances of ``python -c pass`` started by poprun, by ``torchrun
  --nproc-per-node 2`` and by bare ``mpiexec -n 2``, to their exit.
- ``collectives``: 4 replicas, per size: torch.distributed's gloo on 4 ranks, the engine as 4
  instances x 1 replica and raw mpi4py on 4 ranks, all three in the same 4 processes under poprun,
  their batches alternating (``bench.collectives_worker``); and the engine as 2 instances x 2
  replicas, a job of its own, the two jobs alternating round by round. The engine has no
  broadcast (PopXL has none): that row compares gloo with mpi4py only.
- ``training``: samples/s of the engine's Trainer and of torch DistributedDataParallel (gloo) on
  the same model, data, optimizer and global batch, 1 and 2 processes, one BLAS thread each
  (``bench.peers_training_worker``); jobs alternate round by round.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.timing import time_commands

BIN = Path(sys.executable).parent
SAMPLER_SIZES = [10**5, 10**6, 10**7]
QUICK_SAMPLER_SIZES = [10**5, 10**6]
#: Targets: the shuffled sampler at n = 10**7 within 1.5x torch's time; poprun's launch no slower
#: than torchrun's (its target against bare mpiexec is the launch section's, with MPI initialised).
SAMPLER_LIMIT = 1.5
#: ... and the engine's 2 x 2 all-reduce of 16 MiB per replica within 0.3x gloo's 4-rank time.
ALLREDUCE_LIMIT = 0.3
COLLECTIVE_SIZES = [1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
QUICK_COLLECTIVE_SIZES = [1 << 10, 1 << 20, 16 << 20]
OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast")
#: ... and the Trainer's samples/s at 2 processes at least 1.1x DDP's, its scaling at least DDP's.
TRAINING_LIMIT = 1.1
TRAINING_BATCH = 2048
WORKER = ["-m", "bench.collectives_worker"]
LAUNCH_TORCHRUN_LIMIT = 1.0


def sampler(sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    import torch.utils.data

    from popdist_py.data import DistributedSampler

    class Indices(torch.utils.data.Dataset[int]):
        """What torch's sampler needs of a dataset: its length."""

        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, index: int) -> int:
            return index

    rows = []
    for n in sizes:
        ours = DistributedSampler(n, num_replicas=2, rank=0, shuffle=True, seed=0)
        theirs: torch.utils.data.DistributedSampler[int] = torch.utils.data.DistributedSampler(
            Indices(n), num_replicas=2, rank=0, shuffle=True, seed=0)
        if list(ours) != list(theirs):
            raise AssertionError(f"the samplers' lists differ at n={n}")
        seconds: dict[str, list[float]] = {"popdist_py": [], "torch": []}
        for _ in range(rounds):
            for name, contender in (("popdist_py", ours), ("torch", theirs)):
                start = time.perf_counter()
                list(contender)
                seconds[name].append(time.perf_counter() - start)
        median = {name: statistics.median(values) for name, values in seconds.items()}
        rows.append({"n": n, "seconds": median, "ratio": median["popdist_py"] / median["torch"], "identical": True})
    return rows


def launch(rounds: int) -> dict[str, Any]:
    python = sys.executable
    program = [python, "-c", "pass"]
    # torchrun leaves a directory of its logs per run: in /tmp unless given one, here removed after.
    with tempfile.TemporaryDirectory(prefix="bench-torchrun-") as logs:
        times = time_commands({
            "mpiexec": [str(BIN / "mpiexec"), "-n", "2", *program],
            "poprun": [str(BIN / "poprun"), "--num-instances", "2", *program],
            "torchrun": [str(BIN / "torchrun"), "--nproc-per-node", "2", "--log-dir", logs, "--no-python", *program],
        }, rounds=rounds)
    poprun = times["poprun"]["median"]
    return {"seconds": times, "poprun_over_mpiexec": poprun / times["mpiexec"]["median"],
            "poprun_over_torchrun": poprun / times["torchrun"]["median"]}


def collectives(sizes: list[int], rounds: int, ops: tuple[str, ...] = OPS) -> dict[str, list[dict[str, Any]]]:
    from bench.collectives import worker_times

    python, poprun = sys.executable, str(BIN / "poprun")
    result: dict[str, list[dict[str, Any]]] = {}
    for op in ops:
        listed = [str(size) for size in sizes]
        kinds = "raw+gloo" if op == "broadcast" else "engine+raw+gloo"
        jobs = {"4x1": [poprun, "--num-instances", "4", python, *WORKER, kinds, op, *listed]}
        if op != "broadcast":
            jobs["2x2"] = [poprun, "--num-instances", "2", "--num-replicas", "4", python, *WORKER, "engine", op,
                           *listed]
        samples: dict[str, dict[int, list[float]]] = {}
        for _ in range(rounds):
            for split, command in jobs.items():
                for size, times in worker_times(command).items():
                    for kind, seconds in times.items():
                        name = {"engine": f"engine_{split}", "raw": "mpi4py_4", "gloo": "gloo_4"}[kind]
                        samples.setdefault(name, {}).setdefault(size, []).append(seconds)
        rows = []
        for size in sizes:
            row: dict[str, Any] = {"bytes_per_replica": size}
            row.update({name: statistics.median(by_size[size]) for name, by_size in samples.items()})
            for name in ("engine_2x2", "engine_4x1", "mpi4py_4"):
                if name in row:
                    row[f"{name}_over_gloo"] = row[name] / row["gloo_4"]
            rows.append(row)
        result[op] = rows
    return result


def training(rounds: int, steps: int, global_batch: int = TRAINING_BATCH) -> dict[str, Any]:
    from bench.scaling import throughput

    python, poprun = sys.executable, str(BIN / "poprun")
    samples: dict[str, dict[str, list[float]]] = {framework: {"1": [], "2": []} for framework in ("engine", "ddp")}
    for _ in range(rounds):
        for processes in ("1", "2"):
            for framework, by_processes in samples.items():
                by_processes[processes].append(throughput([
                    poprun, "--num-instances", processes, python, "-m", "bench.peers_training_worker", framework,
                    str(global_batch), str(steps)]))
    median = {framework: {n: statistics.median(values) for n, values in by_processes.items()}
              for framework, by_processes in samples.items()}
    return {"model": (f"MLP 1024-1024-1024-16 without biases, float32, SGD, global batch {global_batch}, one BLAS "
                      "thread per process"),
            "samples_per_s": median,
            "scaling": {framework: values["2"] / values["1"] for framework, values in median.items()},
            "engine_over_ddp": {n: median["engine"][n] / median["ddp"][n] for n in ("1", "2")}}


def run(quick: bool) -> dict[str, object]:
    sizes = QUICK_SAMPLER_SIZES if quick else SAMPLER_SIZES
    rows = sampler(sizes, rounds=3 if quick else 5)
    started = launch(rounds=3 if quick else 9)
    reduced = collectives(QUICK_COLLECTIVE_SIZES if quick else COLLECTIVE_SIZES, rounds=1 if quick else 3)
    trained = training(rounds=1 if quick else 3, steps=3 if quick else 9)
    largest = rows[-1]
    over_ddp, scaling = trained["engine_over_ddp"]["2"], trained["scaling"]
    [allreduce_16] = [row for row in reduced["allreduce"] if row["bytes_per_replica"] == 16 << 20]
    engine_over_gloo = allreduce_16["engine_2x2_over_gloo"]
    targets = [
        {"what": "all-reduce 16 MiB per replica: engine 2x2 / gloo 4 ranks", "limit": ALLREDUCE_LIMIT,
         "value": engine_over_gloo, "holds": engine_over_gloo <= ALLREDUCE_LIMIT},
        {"what": "training samples/s at 2 processes: engine Trainer / torch DDP (at least)", "limit": TRAINING_LIMIT,
         "value": over_ddp, "holds": over_ddp >= TRAINING_LIMIT},
        {"what": "training scaling 1 -> 2 processes: engine's / DDP's (at least)", "limit": 1.0,
         "value": scaling["engine"] / scaling["ddp"], "holds": scaling["engine"] >= scaling["ddp"]},
        {"what": f"shuffled DistributedSampler, n = {largest['n']:.0e}: popdist_py / torch", "limit": SAMPLER_LIMIT,
         "value": largest["ratio"], "holds": largest["ratio"] <= SAMPLER_LIMIT},
        {"what": "launch 2 instances: poprun / torchrun", "limit": LAUNCH_TORCHRUN_LIMIT,
         "value": started["poprun_over_torchrun"], "holds": started["poprun_over_torchrun"] <= LAUNCH_TORCHRUN_LIMIT},
    ]
    return {"sampler": rows, "launch": started, "collectives": reduced, "training": trained, "targets": targets}
