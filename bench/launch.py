"""``launch``: poprun against bare mpiexec, starting 2 instances that init MPI, and that do nothing;
and the CPU a job costs when its instances end at different times (MPICH's hydra proxy
busy-waits from its first child's exit to its last; poprun's shims exit together)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from bench.timing import cpu_seconds, time_commands

BIN = Path(sys.executable).parent
TARGET_RATIO = 1.5
#: Instance 1 ends this long after instance 0 in the ``skewed_exit`` case.
SKEW_SECONDS = 0.3


def run(quick: bool) -> dict[str, object]:
    python = sys.executable
    programs = {"mpi_init": [python, "-c", "from mpi4py import MPI"], "pass": [python, "-c", "pass"]}
    result: dict[str, object] = {}
    for name, program in programs.items():
        times = time_commands({
            "mpiexec": [str(BIN / "mpiexec"), "-n", "2", *program],
            "poprun": [str(BIN / "poprun"), "--num-instances", "2", *program],
        }, rounds=5 if quick else 15)
        ratio = times["poprun"]["median"] / times["mpiexec"]["median"]
        result[name] = {"seconds": times, "ratio": ratio}
    result["skewed_exit"] = skewed_exit(python, rounds=3 if quick else 5)
    ratio = result["mpi_init"]["ratio"]  # type: ignore[index]
    result["target"] = {"what": "poprun / mpiexec, 2 instances initialising MPI", "limit": TARGET_RATIO,
                        "value": ratio, "holds": ratio <= TARGET_RATIO}
    return result


def skewed_exit(python: str, rounds: int) -> dict[str, object]:
    """CPU seconds of the whole job tree when instance 1 ends SKEW_SECONDS after instance 0."""
    program = [python, "-c", f"import os, time; time.sleep({SKEW_SECONDS} * int(os.environ['PMI_RANK']))"]
    commands = {"mpiexec": [str(BIN / "mpiexec"), "-n", "2", *program],
                "poprun": [str(BIN / "poprun"), "--num-instances", "2", *program]}
    cpu: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(rounds):
        for name, command in commands.items():
            cpu[name].append(cpu_seconds(command, timeout=60))
    medians = {name: statistics.median(values) for name, values in cpu.items()}
    return {"skew_seconds": SKEW_SECONDS, "cpu_seconds": medians, "ratio": medians["poprun"] / medians["mpiexec"]}

