"""SIGKILLed instances and instances that left early, as the summary tells them: the kernel's
out-of-memory killer named, two instances SIGKILLed together both failures. (An MPI program that
left through os._exit(0), named with a status of its own, is test_poprun_failures.py's: one job
for each of MPICH's waits.)"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from poprun_py.host import oom
from tests.helpers import POPRUN, PYTHON, poprun, run, task_state, wait_until

pytestmark = pytest.mark.slow
#: The test cgroup's memory limit: poprun, mpiexec and two stubs fit well within it; a program
#: that keeps allocating does not.
LIMIT = 192 << 20


def _memory_cgroup() -> tuple[Path, str] | None:
    """This process's memory cgroup folder and the file of its limit (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), when a child group can be made there; None otherwise."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            for root in (Path(oom.CGROUP_ROOT), Path(oom.CGROUP_ROOT) / "unified"):
                folder = root / path.lstrip("/")
                if (folder / "memory.events").exists() and "memory" in (folder / "cgroup.subtree_control").read_text():
                    return folder, "memory.max"
        elif "memory" in controllers.split(","):
            folder = Path(oom.CGROUP_ROOT) / "memory" / path.lstrip("/")
            if (folder / "memory.oom_control").exists():
                return folder, "memory.limit_in_bytes"
    return None


@contextlib.contextmanager
def small_memory_cgroup() -> Iterator[Path]:
    """A child memory cgroup of LIMIT bytes (no swap), removed after."""
    found = _memory_cgroup()
    if found is None or os.geteuid() != 0:
        pytest.skip("no memory cgroup this test can make a child group in (needs root and the memory controller)")
    parent, limit_file = found
    group = parent / f"poprun-oom-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a child memory cgroup in {parent}: {exc}")
    try:
        (group / limit_file).write_text(str(LIMIT))
        for swap in ("memory.memsw.limit_in_bytes", "memory.swap.max"):  # v1, v2: no swapping instead
            if (group / swap).exists():
                (group / swap).write_text(str(LIMIT) if swap.endswith("in_bytes") else "0")
        yield group
    finally:
        wait_until(lambda: not (group / "cgroup.procs").read_text().strip(), "the test cgroup to empty", within=30)
        group.rmdir()


#: Run as root in a mount namespace of its own: a cgroup file system of files (tmpfs on
#: oom.CGROUP_ROOT) laid out as argv[1] says for this process's own cgroups, then oom.kills().
FAKE_CGROUPS = r"""import os, subprocess, sys
from poprun_py.host import oom
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", oom.CGROUP_ROOT], check=True)
layout = sys.argv[1]
for line in open("/proc/self/cgroup").read().splitlines():
    _, controllers, path = line.split(":", 2)
    if controllers == "" and layout in ("v2", "unified"):
        folder = os.path.join(oom.CGROUP_ROOT, *(["unified"] if layout == "unified" else []), path.lstrip("/"))
        name, text = "memory.events", "low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n"
    elif "memory" in controllers.split(",") and layout == "v1":
        folder = os.path.join(oom.CGROUP_ROOT, "memory", path.lstrip("/"))
        name, text = "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"
    else:
        continue
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, name), "w").write(text)
print(oom.kills())
"""


@pytest.mark.parametrize("layout,count", [("v2", "2"), ("unified", "2"), ("v1", "3"), ("none", "None")])
def test_the_oom_kill_count_is_read_where_each_cgroup_version_keeps_it(layout: str, count: str) -> None:
    """cgroup v2's ``memory.events`` (alone, or as ``unified`` beside v1), v1's ``memory.oom_control``,
    each at this process's own cgroup; None where neither is."""
    controllers = [line.split(":", 2)[1] for line in Path("/proc/self/cgroup").read_text().splitlines()]
    needed = {"v2": "" in controllers, "unified": "" in controllers, "none": True,
              "v1": any("memory" in listed.split(",") for listed in controllers)}
    if os.geteuid() != 0 or not needed[layout]:
        pytest.skip(f"needs root and this process in a cgroup of the {layout} layout")
    result = run(["unshare", "--mount", "--propagation", "private", PYTHON, "-c", FAKE_CGROUPS, layout])
    if result.returncode != 0 and "unshare" in result.stderr:
        pytest.skip(f"no mount namespace can be made here: {result.stderr.strip()}")
    assert (result.returncode, result.stdout) == (0, f"{count}\n"), result.stderr


def test_an_instance_the_out_of_memory_killer_ended_is_named_so(tmp_path: Path) -> None:
    """Instance 1 allocates past its cgroup's memory limit and the kernel's OOM killer SIGKILLs it:
    the summary and --error-file say so, and it is the root cause (a failure, not a stop)."""
    program = ("import os, time\n"
               "if os.environ['RANK'] == '1':\n"
               "    held = []\n"
               "    while True: held.append(b'x' * (16 << 20))\n"
               "time.sleep(120)\n")
    error_file = tmp_path / "error.json"
    with small_memory_cgroup() as group:
        # The wrapper moves itself (0: the writer) into the group, then becomes poprun.
        result = run(["sh", "-c", 'echo 0 > "$0/cgroup.procs" && exec "$@"', str(group), *POPRUN,
                      "--error-file", str(error_file), "--num-instances", "2", PYTHON, "-c", program], timeout=90)
    assert result.returncode == 137, result.stderr
    assert re.search(r"^poprun: instance 1 on \S+ failed: killed by SIGKILL \(status 137\) from the kernel's "
                     r"out-of-memory killer \(its memory cgroup's oom_kill count rose\)$", result.stderr,
                     re.M), result.stderr
    assert "stopped instance(s) 0 (1 of 2)" in result.stderr, result.stderr
    record = json.loads(error_file.read_text())[-1]
    assert (record["instance"], record["signal"]) == (1, "SIGKILL") and "out-of-memory killer" in record["reason"]


def test_a_sigkill_by_hand_is_not_called_the_out_of_memory_killers() -> None:
    """A SIGKILL that no OOM kill came with is only a SIGKILL."""
    result = poprun("--num-instances", "1", PYTHON, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert result.returncode == 137, result.stderr
    assert re.search(r"^poprun: instance 0 on \S+ failed: killed by SIGKILL \(status 137\)$", result.stderr, re.M)


def test_two_instances_sigkilled_at_once_are_both_failures(tmp_path: Path) -> None:
    """Both programs die of SIGKILL at once: their stubs are held (SIGSTOP) while the test kills
    both programs and sees both dead, then let go (SIGCONT), so each stub finds its program dead,
    whichever of them poprun hears first and tells the other to stop. Both are failures, neither
    was stopped by poprun."""
    program = ["-c", (f"import os, time; open(os.path.join({str(tmp_path)!r}, os.environ['RANK']), 'w')"
                      ".write(f'{os.getpid()} {os.getppid()}'); time.sleep(120)")]
    error_file = tmp_path / "error.json"
    with subprocess.Popen([*POPRUN, "--error-file", str(error_file), "--num-instances", "2", PYTHON, *program],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as job:
        try:
            files = [tmp_path / str(rank) for rank in range(2)]
            wait_until(lambda: all(f.exists() and " " in f.read_text() for f in files), "both programs' pids")
            pids = [[int(pid) for pid in f.read_text().split()] for f in files]  # each: program, its stub
            stubs = [stub for _, stub in pids]
            try:
                for stub in stubs:
                    os.kill(stub, signal.SIGSTOP)
                for program_pid, _ in pids:
                    os.kill(program_pid, signal.SIGKILL)
                wait_until(lambda: all(task_state(f"/proc/{p}") == "Z" for p, _ in pids), "both programs dead")
            finally:
                for stub in stubs:
                    os.kill(stub, signal.SIGCONT)
            _, stderr = job.communicate(timeout=60)
        finally:
            job.kill()
    assert job.returncode == 137, stderr
    first = re.search(r"^poprun: instance (\d) on \S+ failed: killed by SIGKILL \(status 137\)$", stderr, re.M)
    assert first, stderr
    other = 1 - int(first.group(1))
    assert re.search(rf"^poprun: instance {other} on \S+ also failed: killed by SIGKILL \(status 137\)$", stderr,
                     re.M), stderr
    assert "stopped instance" not in stderr, stderr
    record = json.loads(error_file.read_text())[-1]
    assert sorted((f["instance"], f["signal"]) for f in record["failures"]) == [(0, "SIGKILL"), (1, "SIGKILL")], record
    assert record["stopped"] == [], record

