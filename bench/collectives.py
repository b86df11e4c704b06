"""``allreduce`` (+ all-gather, reduce-scatter): the engine at 2 instances x 2 replicas against
flat 4-rank mpi4py and 2-rank raw mpi4py, per size, with algbw/busbw (nccl-tests convention);
and a 1 KiB all-reduce under each executor, which shows where a small collective's time goes.

The 2-rank raw all-reduce is timed inside the engine's job, its batches alternating with the
engine's (``engine+raw``), so their ratio does not depend on when each job happened to run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
SIZES = [1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [1 << 10, 1 << 20, 16 << 20]
#: The small all-reduce whose time is taken apart by executor (:func:`latency`).
LATENCY_BYTES = 1 << 10
WORKER = ["-m", "bench.collectives_worker"]
#: nccl-tests' bus-bandwidth factors for n participants.
BUS_FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n}


def worker_times(command: list[str]) -> dict[int, dict[str, float]]:
    """Run ``bench.collectives_worker`` (under ``command``'s launcher): its ``{size: {kind: seconds}}``."""
    out = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    line = [ln for ln in out.stdout.splitlines() if ln.lstrip("[0123456789] ").startswith("{")][-1]
    return {int(k): v for k, v in json.loads(line.split("] ", 1)[-1]).items()}  # {size: {kind: seconds}}


def _entry(op: str, nbytes: int, seconds: float, participants: int) -> dict[str, float]:
    # nccl-tests: S is the per-rank buffer for all-reduce, the whole array for gather/scatter.
    size = nbytes * participants if op == "allgather" else nbytes
    algbw = size / seconds / 1e9
    return {"seconds": seconds, "algbw_GBps": algbw, "busbw_GBps": algbw * BUS_FACTOR[op](participants)}


def latency(nbytes: int) -> dict[str, object]:
    """Where a small all-reduce's time goes: the engine under each executor, at 2x2 beside raw
    2-rank mpi4py in the same job, and at 1x2 (no MPI: the local replicas' meeting alone)."""
    python, poprun = str(BIN / "python"), str(BIN / "poprun")
    splits = {"2x2": ("2", "4", "threads+cooperative+raw"), "1x2": ("1", "2", "threads+cooperative")}
    seconds = {}
    for split, (instances, replicas, kinds) in splits.items():
        times = worker_times([poprun, "--num-instances", instances, "--num-replicas", replicas, python, *WORKER,
                              kinds, "allreduce", str(nbytes)])
        seconds[split] = times[nbytes]
    cores = os.cpu_count() or 1
    auto = {split: ("threads" if cores // int(instances) >= 2 else "cooperative")
            for split, (instances, _, _) in splits.items()}
    return {"bytes_per_replica": nbytes, "seconds": seconds, "auto": auto, "handoff_seconds": handoff()}


def handoff(rounds: int = 20000) -> float:
    """Seconds for one hand-off between two Python threads that wake each other through locks (a
    ping-pong; the threads executor's floor for a collective's wake-up, on this host)."""
    ping, pong = threading.Lock(), threading.Lock()
    ping.acquire()
    pong.acquire()

    def other() -> None:
        for _ in range(rounds):
            ping.acquire()
            pong.release()

    thread = threading.Thread(target=other)
    thread.start()
    start = time.perf_counter()
    for _ in range(rounds):
        ping.release()
        pong.acquire()
    elapsed = time.perf_counter() - start
    thread.join()
    return elapsed / (2 * rounds)


def run(quick: bool) -> dict[str, object]:
    sizes = QUICK_SIZES if quick else SIZES
    python = sys.executable
    result: dict[str, object] = {}
    #: The all-reduce's ratios by size, which the targets are read from.
    allreduce_ratios: dict[int, dict[str, float]] = {}
    for op in ("allreduce", "allgather", "reduce_scatter"):
        sz = [str(s) for s in (sizes if op == "allreduce" else [s for s in sizes if s >= 1 << 20])]
        # The 2-rank raw all-reduce runs in the engine's own 2 processes, alternating with it.
        both = op == "allreduce"
        engine = worker_times([str(BIN / "poprun"), "--num-instances", "2", "--num-replicas", "4",
                       python, *WORKER, "engine+raw" if both else "engine", op, *sz])
        flat4 = worker_times([str(BIN / "mpiexec"), "-n", "4", python, *WORKER, "raw", op, *sz])
        rows: list[dict[str, object]] = []
        for s in map(int, sz):
            e = engine[s]["engine"]
            ratios = {"ratio_engine_to_flat_4": e / flat4[s]["raw"]}
            row: dict[str, object] = {"bytes_per_replica": s, "engine_2x2": _entry(op, s, e, 4),
                                      "mpi4py_flat_4": _entry(op, s, flat4[s]["raw"], 4)}
            if both:
                row["mpi4py_raw_2"] = _entry(op, s, engine[s]["raw"], 2)
                ratios["ratio_engine_to_raw_2"] = e / engine[s]["raw"]
                allreduce_ratios[s] = ratios
            rows.append({**row, **ratios})
        result[op] = rows
    targets = []
    if 16 << 20 in allreduce_ratios:
        ratios = allreduce_ratios[16 << 20]
        targets.append({"what": "2x2 all-reduce 16 MiB / flat 4-rank Allreduce", "limit": 0.75,
                        "value": ratios["ratio_engine_to_flat_4"], "holds": ratios["ratio_engine_to_flat_4"] <= 0.75})
        targets.append({"what": "2x2 all-reduce 16 MiB / 2-rank raw Allreduce", "limit": 1.5,
                        "value": ratios["ratio_engine_to_raw_2"], "holds": ratios["ratio_engine_to_raw_2"] <= 1.5})
    result["latency_1k"] = latency(LATENCY_BYTES)
    ratios = allreduce_ratios[1 << 10]
    targets.append({"what": "2x2 all-reduce 1 KiB / 2-rank raw Allreduce latency", "limit": 3.0,
                    "value": ratios["ratio_engine_to_raw_2"], "holds": ratios["ratio_engine_to_raw_2"] <= 3.0})
    result["targets"] = targets
    return result
