"""``launch``: poprun against bare mpiexec, starting 2 instances that init MPI, and that do nothing,
with the floor of a launcher shaped like poprun beside them (``launch_floor``: its interpreter,
click's import, gforker and a ``python -S`` hop per instance, and nothing else); the CPU a job
costs when its instances end at different times (MPICH's hydra proxy busy-waits from its first
child's exit to its last; poprun's stubs exit together); and each stub's own CPU and peak
resident memory. (Jobs of many instances: the ``scale`` section.)"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.timing import cpu_seconds, summarize, time_commands
from poprun_py.planning import per_instance

BIN = Path(sys.executable).parent
TARGET_RATIO = 1.5
#: Instance 1 ends this long after instance 0 in the ``skewed_exit`` case.
SKEW_SECONDS = 0.3
#: The floor's script, timed without and with click's import beside bare mpiexec and poprun.
FLOOR = str(Path(__file__).with_name("launch_floor.py"))
#: The probe's pause before it reads its stub: by then the stub has set its loop up.
PROBE_PAUSE_SECONDS = 0.2


def run(quick: bool) -> dict[str, object]:
    python = sys.executable
    programs = {"mpi_init": [python, "-c", "from mpi4py import MPI"], "pass": [python, "-c", "pass"]}
    result: dict[str, object] = {}
    for name, program in programs.items():
        times = time_commands({
            "mpiexec": [str(BIN / "mpiexec"), "-n", "2", *program],
            "poprun": [str(BIN / "poprun"), "--num-instances", "2", *program],
            "floor": [python, FLOOR, "2", *program],
            "floor_click": [python, FLOOR, "--click", "2", *program],
        }, rounds=5 if quick else 15)
        result[name] = {"seconds": times, "ratio": times["poprun"]["median"] / times["mpiexec"]["median"]}
    result["skewed_exit"] = skewed_exit(python, rounds=3 if quick else 5)
    result["per_instance"] = per_instance_cost(rounds=3 if quick else 10)
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



def per_instance_cost(rounds: int) -> dict[str, object]:
    """The own CPU (user + system, its threads only: not the program's) and peak resident memory
    (VmHWM) of what runs each instance (the stub this install has, or what POPRUN_STUB names), read
    from /proc by its program (``sh``, its child) as the program's last act, 2 instances a job: its
    start, the exchange with its supervisor, the program's start, without its end (its exit report
    and the wait for RELEASE)."""
    chosen = per_instance.mode()
    name = os.path.basename(per_instance.stub_command(chosen)[-1]).encode()
    cpu: list[float] = []
    peak: list[float] = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as folder:
            probe = (f"sleep {PROBE_PAUSE_SECONDS}; cat /proc/$PPID/schedstat > {folder}/$PMI_RANK.cpu; "
                     f"grep VmHWM /proc/$PPID/status > {folder}/$PMI_RANK.rss; "
                     f"cat /proc/$PPID/cmdline > {folder}/$PMI_RANK.cmdline")
            subprocess.run([str(BIN / "poprun"), "--num-instances", "2", "sh", "-c", probe], check=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=60)
            for rank in range(2):
                parent = Path(folder, f"{rank}.cmdline").read_bytes().split(b"\0")
                if name not in b" ".join(parent):
                    raise RuntimeError(f"the probe's parent is not {name.decode()}: {parent!r}")
                # schedstat: time on a CPU, ns; VmHWM: kB
                cpu.append(int(Path(folder, f"{rank}.cpu").read_text().split()[0]) / 1e9)
                peak.append(int(Path(folder, f"{rank}.rss").read_text().split()[1]) / 1024)
    return {"runs_under": chosen, "cpu_seconds": summarize(cpu), "peak_rss_mib": summarize(peak),
            "cores": os.cpu_count()}
