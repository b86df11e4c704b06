"""``scale``: what poprun adds per instance and per host, against bare mpiexec in the same run.

Jobs of 1 to 1,024 instances of ``/bin/true`` and of ``python -c "from mpi4py import MPI"``, poprun
and bare mpiexec interleaved round by round: wall time and the CPU of the whole process tree. Then
the memory: jobs of instances that wait (``cat`` on a FIFO, the same program under both), read
while every instance waits, the unique (USS) and proportional (PSS) memory of the whole process
tree summed; poprun's extra at one instance is its cost per host, and what that extra grows by per
instance its cost per instance. poprun runs under a soft limit of 1,024 open files (``ulimit -Sn
1024``), the usual default, which it raises to the hard limit as srun does; bare mpiexec with its
soft limit raised to the hard one beforehand, as its users must (``raised``).
"""

from __future__ import annotations

import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.timing import time_commands_with_cpu

BIN = Path(sys.executable).parent
#: Instances of ``/bin/true``; the quick run's.
TRUE_COUNTS, TRUE_COUNTS_QUICK = (1, 32, 128, 512, 1024), (1, 32)
#: Instances of the MPI import (each a Python interpreter initialising MPI: ~0.1 s of CPU). Not 512
#: or 1,024: bare mpiexec's own jobs of that size sat blocked in MPI's start (no CPU used) for 7 and
#: 10 minutes on this 2-core host (2026-12-06; one of 512 had finished in an earlier run), so
#: there is nothing to compare with.
MPI_COUNTS, MPI_COUNTS_QUICK = (1, 2, 32, 128), (1, 2)
#: Rounds of the short jobs, whose medians the targets name: up to 128 instances of /bin/true and
#: 2 of the MPI import take well under a second each (noise between runs moved the 128-instance
#: ratio by 0.4 and the 2-instance MPI one by 0.16 at three rounds and one).
SHORT_TRUE, SHORT_MPI, SHORT_ROUNDS = 128, 2, 7
#: Instances whose memory is read; the quick run's.
MEMORY_COUNTS, MEMORY_COUNTS_QUICK = (1, 64, 256), (1, 4)
#: The open-file limit the jobs run under: the usual default soft limit.
SOFT_FILE_LIMIT = 1024
#: The targets (issue 50), ratios to bare mpiexec in the same run.
TARGETS = {"true_128": 3.0, "true_1024": 3.0, "mpi_2": 1.5, "hosts": 3.0}
#: Added per instance at most: CPU (s) and unique memory (MiB).
PER_INSTANCE_CPU, PER_INSTANCE_USS = 0.001, 1.0
#: The multi-host row: the test cluster's hosts and the instances on each (quick: fewer).
HOSTS, PER_HOST, PER_HOST_QUICK = 3, 64, 4
#: How long a memory job may take to have every instance waiting.
READY_TIMEOUT = 300


def limited() -> None:
    """In poprun's child, before exec: the soft limit of open files at SOFT_FILE_LIMIT."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(SOFT_FILE_LIMIT, hard), hard))


def raised() -> None:
    """In bare mpiexec's child, before exec: the soft limit of open files at the hard one. Hydra
    needs it: under a soft limit of 1,024 it fails from about 300 instances on ("error waiting
    for event"), so its users raise it by hand (``ulimit -n``); poprun raises its own."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


#: What each contender's child runs before its exec.
LIMITS = {"mpiexec": raised, "poprun": limited}


def commands(count: int, program: Sequence[str]) -> dict[str, Sequence[str]]:
    return {"mpiexec": [str(BIN / "mpiexec"), "-n", str(count), *program],
            "poprun": [str(BIN / "poprun"), "--num-instances", str(count), *program]}


def timed_rows(counts: Sequence[int], program: Sequence[str], rounds: int,
               short: tuple[int, int] = (0, 0)) -> dict[str, object]:
    """Wall and whole-tree CPU of jobs of ``count`` instances of ``program``, for each count, over
    ``rounds`` rounds; ``short``: (up to how many instances, the rounds of such a job) where more."""
    rows: dict[str, object] = {}
    for count in counts:
        measured = time_commands_with_cpu(commands(count, program), timeout=900, preexec=LIMITS,
                                          rounds=max(rounds, short[1]) if count <= short[0] else rounds)
        seconds = {name: m["seconds"] for name, m in measured.items()}
        cpu = {name: m["cpu_seconds"] for name, m in measured.items()}
        rows[str(count)] = {"seconds": seconds, "cpu_seconds": cpu,
                            "ratio": seconds["poprun"]["median"] / seconds["mpiexec"]["median"],
                            "cpu_ratio": cpu["poprun"]["median"] / cpu["mpiexec"]["median"]}
    return rows


def added_cpu_per_instance(rows: dict[str, object]) -> float:
    """CPU seconds poprun adds per instance beyond bare mpiexec, from the first and last rows."""
    counts = sorted(rows, key=int)
    first, last = rows[counts[0]], rows[counts[-1]]

    def extra(row: object) -> float:
        cpu = row["cpu_seconds"]  # type: ignore[index]
        return float(cpu["poprun"]["median"] - cpu["mpiexec"]["median"])

    return (extra(last) - extra(first)) / (int(counts[-1]) - int(counts[0]))


def tree(root: int) -> list[int]:
    """``root`` and every live process below it (one reading of /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as stat:
                    parent = int(stat.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(name))
    found, below = [root], list(children.get(root, ()))
    while below:
        pid = below.pop()
        found.append(pid)
        below += children.get(pid, ())
    return found


def memory_of(pids: Sequence[int]) -> dict[str, float]:
    """Summed USS (private pages) and PSS of ``pids``, MiB (``smaps_rollup``)."""
    uss = pss = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                fields = {line.split(":")[0]: int(line.split()[1]) for line in rollup if line.endswith("kB\n")}
        except (OSError, ValueError):
            continue
        uss += fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
        pss += fields.get("Pss", 0)
    return {"uss_mib": uss / 1024, "pss_mib": pss / 1024}


def _waiting(pids: Sequence[int], fifo: str) -> int:
    """How many of ``pids`` are the waiting program (``cat`` on ``fifo``)."""
    count = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if cmdline.read() == f"cat\0{fifo}\0".encode():
                    count += 1
        except OSError:
            continue
    return count


def job_memory(name: str, command: Sequence[str], count: int, fifo: str) -> dict[str, float]:
    """The memory of ``command``'s whole tree once its ``count`` instances all wait on ``fifo``;
    then the FIFO is opened and closed, every instance reads its end, and the job ends."""
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, preexec_fn=LIMITS[name])
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while _waiting(pids := tree(process.pid), fifo) < count:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{command[0]}: {count} instances did not all wait (status {process.poll()})")
            time.sleep(0.05)
        memory = memory_of(pids)
        os.close(os.open(fifo, os.O_WRONLY))  # the readers' opens return; each reads the end
        process.wait(timeout=READY_TIMEOUT)
        return memory
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)


def memory_rows(counts: Sequence[int], rounds: int) -> dict[str, object]:
    """Per count, the medians of each job's tree memory, poprun and bare mpiexec interleaved."""
    rows: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as folder:
        fifo = os.path.join(folder, "go")
        os.mkfifo(fifo)
        for count in counts:
            samples: dict[str, list[dict[str, float]]] = {"mpiexec": [], "poprun": []}
            for _ in range(rounds):
                for name, command in commands(count, ["cat", fifo]).items():
                    samples[name].append(job_memory(name, command, count, fifo))
            rows[str(count)] = {name: {key: statistics.median(s[key] for s in taken) for key in ("uss_mib", "pss_mib")}
                                for name, taken in samples.items()}
    return rows


def added_memory(rows: dict[str, object]) -> dict[str, float]:
    """poprun's extra USS and PSS (MiB) at one instance (per host) and per further instance."""
    counts = sorted(rows, key=int)

    def extra(count: str, key: str) -> float:
        row = rows[count]
        return float(row["poprun"][key] - row["mpiexec"][key])  # type: ignore[index]

    span = int(counts[-1]) - int(counts[0])
    return {f"{scope}_{key}": value for key in ("uss_mib", "pss_mib")
            for scope, value in (("per_host", extra(counts[0], key)),
                                 ("per_instance", (extra(counts[-1], key) - extra(counts[0], key)) / span))}


def across_hosts(quick: bool) -> dict[str, object]:
    """HOSTS test hosts (``tests/cluster.py``: network namespaces, root only) x PER_HOST instances of
    ``/bin/true``, poprun beside bare ``mpiexec -hosts`` on the same hosts: wall time, and the CPU
    used on this machine (the remote processes are not its children)."""
    from bench.multihost import network_env
    from tests.cluster import Cluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        return {"skipped": reason}
    per_host = PER_HOST_QUICK if quick else PER_HOST
    with network_env(), Cluster(HOSTS) as cluster:
        count = str(per_host * HOSTS)
        measured = time_commands_with_cpu({
            "mpiexec": [str(BIN / "mpiexec"), "-hosts", ",".join(f"{h}:{per_host}" for h in cluster.names),
                        "-localhost", cluster.bridge_addresses[0], "-n", count, "/bin/true"],
            "poprun": [str(BIN / "poprun"), "--num-instances", count, "-H", ",".join(cluster.names), "/bin/true"],
        }, rounds=2 if quick else 5, timeout=300, preexec=LIMITS)
        names = list(cluster.names)
    seconds = {name: m["seconds"] for name, m in measured.items()}
    return {"hosts": names, "per_host": per_host, "seconds": seconds,
            "cpu_seconds_here": {name: m["cpu_seconds"] for name, m in measured.items()},
            "ratio": seconds["poprun"]["median"] / seconds["mpiexec"]["median"]}


def run(quick: bool) -> dict[str, object]:
    rounds = 2 if quick else 3
    short = (0, 0) if quick else (SHORT_TRUE, SHORT_ROUNDS)
    true_rows = timed_rows(TRUE_COUNTS_QUICK if quick else TRUE_COUNTS, ["/bin/true"], rounds, short)
    mpi_rows = timed_rows(MPI_COUNTS_QUICK if quick else MPI_COUNTS, [sys.executable, "-c", "from mpi4py import MPI"],
                          rounds if quick else 1, (0, 0) if quick else (SHORT_MPI, SHORT_ROUNDS))
    memory = memory_rows(MEMORY_COUNTS_QUICK if quick else MEMORY_COUNTS, rounds=1 if quick else 2)
    hosts = across_hosts(quick)
    added = added_memory(memory)
    cpu_per_instance = added_cpu_per_instance(true_rows)
    targets = []
    for key, count, rows in (("true_128", "128", true_rows), ("true_1024", "1024", true_rows),
                             ("mpi_2", "2", mpi_rows)):
        if count in rows:
            ratio = rows[count]["ratio"]  # type: ignore[index]
            what = ("poprun / mpiexec, 2 MPI instances importing mpi4py" if key == "mpi_2" else
                    f"poprun / mpiexec, {count} instances of /bin/true, one host")
            targets.append({"what": what, "limit": TARGETS[key], "value": ratio, "holds": ratio <= TARGETS[key]})
    if "ratio" in hosts:
        ratio = float(hosts["ratio"])  # type: ignore[arg-type]
        targets.append({"what": f"poprun / mpiexec, {HOSTS} test hosts x {hosts['per_host']} instances of /bin/true",
                        "limit": TARGETS["hosts"], "value": ratio, "holds": ratio <= TARGETS["hosts"]})
    targets.append({"what": "CPU poprun adds per instance (ms)", "limit": PER_INSTANCE_CPU * 1e3,
                    "value": cpu_per_instance * 1e3, "holds": cpu_per_instance <= PER_INSTANCE_CPU})
    targets.append({"what": "unique memory poprun adds per instance (MiB)", "limit": PER_INSTANCE_USS,
                    "value": added["per_instance_uss_mib"], "holds": added["per_instance_uss_mib"] <= PER_INSTANCE_USS})
    return {"true": true_rows, "mpi_import": mpi_rows, "memory": memory, "added_memory": added, "hosts": hosts,
            "cpu_seconds_per_instance": cpu_per_instance, "soft_file_limit": SOFT_FILE_LIMIT,
            "rounds": rounds, "targets": targets}
