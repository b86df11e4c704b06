"""Side-by-side timing: alternate the contenders in every round so machine noise hits all alike."""

from __future__ import annotations

import os
import resource
import select
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence


def time_commands(commands: dict[str, Sequence[str]], rounds: int, timeout: float = 120) -> dict[str, dict[str, float]]:
    """Wall time of whole commands: median, min, max over ``rounds`` interleaved runs (seconds)."""
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(rounds):
        for name, command in commands.items():
            samples[name].append(wall_time(command, timeout))
    return {name: summarize(values) for name, values in samples.items()}


def wall_time(command: Sequence[str], timeout: float, preexec_fn: Callable[[], None] | None = None) -> float:
    """Seconds from start to exit, seen the moment the process exits (``preexec_fn``: run in the
    child before the exec, as subprocess's).

    ``subprocess.run(timeout=...)`` polls with sleeps of up to 50 ms, which would round every
    sample up by as much; a pidfd wakes at the exit itself.
    """
    start = time.perf_counter()
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, preexec_fn=preexec_fn)
    exit_fd = os.pidfd_open(process.pid)
    try:
        ready, _, _ = select.select([exit_fd], [], [], timeout)
        elapsed = time.perf_counter() - start
    finally:
        os.close(exit_fd)
    if not ready:
        process.kill()
        process.wait()
        raise subprocess.TimeoutExpired(list(command), timeout)
    if process.wait() != 0:
        raise subprocess.CalledProcessError(process.returncode, list(command))
    return elapsed


def time_commands_with_cpu(commands: dict[str, Sequence[str]], rounds: int, timeout: float = 120,
                           preexec: dict[str, Callable[[], None]] | None = None
                           ) -> dict[str, dict[str, dict[str, float]]]:
    """:func:`time_commands` with the CPU time of each command's whole process tree beside the wall
    time: ``{name: {"seconds": summary, "cpu_seconds": summary}}``. ``preexec``: what to run in a
    command's child before its exec, by the command's name."""
    wall: dict[str, list[float]] = {name: [] for name in commands}
    cpu: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(rounds):
        for name, command in commands.items():
            with CpuAccount() as account:
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                wall[name].append(wall_time(command, timeout, account.joined((preexec or {}).get(name))))
                waited = _cpu_since(before)
            cpu[name].append(waited if account.seconds is None else account.seconds)
    return {name: {"seconds": summarize(wall[name]), "cpu_seconds": summarize(cpu[name])} for name in commands}


class CpuAccount:
    """The CPU time of every process a command starts, through a cgroup of its own (cgroup v1's
    cpuacct, or v2's cpu.stat): also the processes nobody waits for (an orphan that outlives its
    launcher), which ``getrusage(RUSAGE_CHILDREN)`` misses. ``seconds`` is None where no cgroup
    can be made (not root, no cgroup file system): the caller then takes getrusage's."""

    #: Where a cgroup can be made, and its file of the CPU used: v1's cpuacct, v2 (pure or hybrid).
    PLACES = (("/sys/fs/cgroup/cpuacct", "cpuacct.usage"), ("/sys/fs/cgroup/unified", "cpu.stat"),
              ("/sys/fs/cgroup", "cpu.stat"))
    #: How long the cgroup's last processes may take to end after the command has exited.
    DRAIN_SECONDS = 30.0

    def __init__(self) -> None:
        self.folder: str | None = None
        self.usage = ""
        self.seconds: float | None = None

    def __enter__(self) -> CpuAccount:
        for root, usage in self.PLACES:
            folder = os.path.join(root, f"bench-{os.getpid()}-{time.monotonic_ns()}")
            try:
                os.mkdir(folder)
            except OSError:
                continue
            if os.path.exists(os.path.join(folder, usage)):
                self.folder, self.usage = folder, usage
                break
            os.rmdir(folder)
        return self

    def joined(self, then: Callable[[], None] | None) -> Callable[[], None] | None:
        """A child's pre-exec step that moves it into the cgroup, then runs ``then``."""
        if self.folder is None:
            return then
        procs = os.path.join(self.folder, "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as handle:
                handle.write(str(os.getpid()))
            if then is not None:
                then()
        return join

    def __exit__(self, *_: object) -> None:
        if self.folder is None:
            return
        procs = os.path.join(self.folder, "cgroup.procs")
        deadline = time.monotonic() + self.DRAIN_SECONDS
        while time.monotonic() < deadline:
            with open(procs) as handle:
                if not handle.read().strip():
                    break
            time.sleep(0.01)
        with open(os.path.join(self.folder, self.usage)) as handle:
            text = handle.read()
        if self.usage == "cpuacct.usage":
            self.seconds = int(text) / 1e9
        else:
            self.seconds = int(text.split("usage_usec")[1].split()[0]) / 1e6
        try:
            os.rmdir(self.folder)
        except OSError:
            pass


def _cpu_since(before: resource.struct_rusage) -> float:
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def cpu_seconds(command: Sequence[str], timeout: float) -> float:
    """CPU time (user + system) that ``command`` and all its descendants used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall_time(command, timeout)
    return _cpu_since(before)


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}
