"""On one host, an mpiexec that outlives the end of every instance and of every stub has nothing
left to do: poprun stops it after LINGER_SECONDS, and the job's status is the instances'.

MPICH's gforker, a real one, is the launcher that lingers: it misses the end of a stub that comes
while it handles another's failure (then it waits its 2 s limit), and it cannot end while it is
stopped. Each test waits for what the processes do (files, /proc), never for a sleep."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from poprun_py.shared import sweep
from poprun_py.supervision.supervisor import LINGER_SECONDS
from tests.helpers import BIN, OMP_SET, POPRUN, PYTHON, SUBPROCESS_TIMEOUT, run, wait_until

pytestmark = [
    pytest.mark.slow,  # every test starts poprun
    pytest.mark.skipif(not (BIN / "mpiexec.gforker").exists(),
                       reason="needs MPICH's mpiexec.gforker (the mpich wheel)"),
]

STOPPED = f"mpiexec outlived the end of every instance by {LINGER_SECONDS:g} s: stopping it"


def test_after_a_failure_the_launcher_that_missed_a_stubs_end_is_stopped() -> None:
    """Instance 1 leaves without MPI_Finalize; gforker, handling that, misses the end of instance
    0's stub, which poprun stopped meanwhile."""
    program = ("from mpi4py import MPI\nimport os, time\n"
               "os._exit(5) if os.environ['RANK'] == '1' else time.sleep(60)")
    result = run([*POPRUN, "-v", "--num-instances", "2", PYTHON, "-c", program], env=OMP_SET)
    assert result.returncode == 5, result.stderr
    assert _said_stopped(result.stderr), result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("poprun: ")]
    assert len(lines) == 2 and re.fullmatch(r"poprun: instance 1 on \S+ failed: exit status 5", lines[0]), lines
    assert lines[1] == "poprun: stopped instance(s) 0 (1 of 2)"


def test_a_launcher_that_cannot_end_after_a_job_that_succeeded_is_stopped_and_the_job_succeeds(
        tmp_path: Path) -> None:
    """gforker, stopped (SIGSTOP) while its instances end with status 0, can neither collect
    their stubs nor end: poprun stops it and reports success, not its status."""
    program = ("import os, sys, time\nd = sys.argv[1]\n"
               "open(os.path.join(d, 'started' + os.environ['RANK']), 'w').close()\n"
               "while not os.path.exists(os.path.join(d, 'go')): time.sleep(0.01)\n")
    poprun = subprocess.Popen([*POPRUN, "-v", "--num-instances", "2", PYTHON, "-c", program, str(tmp_path)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **OMP_SET})
    gforker = 0
    try:
        wait_until(lambda: all((tmp_path / f"started{i}").exists() for i in range(2)), "the instances did not start")
        (gforker,) = [pid for pid in sweep.descendants(poprun.pid) if _name(pid) == "mpiexec.gforker"]
        os.kill(gforker, signal.SIGSTOP)
        wait_until(lambda: sweep.is_stopped(gforker), "gforker did not stop")
        (tmp_path / "go").touch()
        _, err = poprun.communicate(timeout=SUBPROCESS_TIMEOUT)
    finally:
        if poprun.poll() is None:
            poprun.kill()
            poprun.communicate(timeout=SUBPROCESS_TIMEOUT)
        if gforker and _name(gforker) == "mpiexec.gforker":  # left stopped by a poprun that failed
            os.kill(gforker, signal.SIGKILL)
    assert poprun.returncode == 0, err
    assert _said_stopped(err), err
    assert not [line for line in err.splitlines() if line.startswith("poprun: ") and "OMP_NUM_THREADS" not in line]


def _said_stopped(stderr: str) -> bool:
    """Whether poprun's log (-v) has the line that it stopped mpiexec, once."""
    return [line.split(" [I] ", 1)[-1] for line in stderr.splitlines() if "outlived" in line] == [STOPPED]


def _name(pid: int) -> str:
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return ""
