"""``launch``: poprun against bare mpiexec, starting 2 instances that init MPI, and that do nothing."""

from __future__ import annotations

import sys
from pathlib import Path

from bench.timing import time_commands

BIN = Path(sys.executable).parent
TARGET_RATIO = 1.3


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
    ratio = result["mpi_init"]["ratio"]  # type: ignore[index]
    result["target"] = {"what": "poprun / mpiexec, 2 instances initialising MPI", "limit": TARGET_RATIO,
                        "value": ratio, "holds": ratio <= TARGET_RATIO}
    return result
