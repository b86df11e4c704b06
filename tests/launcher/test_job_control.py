"""Ctrl-Z on poprun's terminal stops the whole job, as it stops a shell job of one process, and
``fg`` continues it: typed into a real interactive bash on a pseudo-terminal."""

from __future__ import annotations

import time

import pytest

from tests.helpers import POPRUN, PYTHON, job_marker, wait_no_processes, wait_until
from tests.launcher.job_shell import CTRL_Z, TICKER, Shell, job_pids, numbers_shown, states, written

pytestmark = pytest.mark.slow  # every test starts poprun
COUNT = 300


def stop_and_continue(shell: Shell, marker: str, instances: int) -> None:
    """With the job typed into ``shell`` and printing: Ctrl-Z stops poprun and every program (state
    T, no progress) and the shell has the terminal back; ``fg`` continues them, and the job ends
    with status 0 having shown every line."""
    for index in range(instances):
        shell.wait_for(rb"\[%d\] 5\r$" % index)
    poprun, programs = job_pids(marker)
    assert len(programs) == instances
    typed = len(shell.shown)
    shell.keys(CTRL_Z)
    shell.wait_for(rb"Stopped", after=typed)  # bash saw its job stop
    wait_until(lambda: set(states([poprun, *programs])) == {"T"}, "poprun and every program stopped")
    progress = written(programs)
    time.sleep(2.0)  # a ticker that ran on would print 100 lines meanwhile
    assert states([poprun, *programs]) == ["T"] * (instances + 1) and written(programs) == progress
    # Typed while the job is stopped: the terminal echoes keys as they come, and typed while the job
    # printed, the echo could land inside one of its lines (seen once in make test, Open MPI on 2 hosts).
    shell.keys("fg; echo status=$?\n")
    wait_until(lambda: "T" not in states(programs), "every program continued")
    status = shell.wait_for(rb"^status=(\d+)\r$", after=typed, within=60)
    assert status.group(1) == b"0", bytes(shell.shown).decode(errors="replace")
    shown = numbers_shown(bytes(shell.shown), instances)
    unlike = {i: (sorted(set(range(COUNT)) - set(numbers)), len(numbers)) for i, numbers in shown.items()
              if numbers != list(range(COUNT))}  # (missing, how many shown): said if any
    assert not unlike, (unlike, bytes(shell.shown)[-3000:])
    assert wait_no_processes(marker) == []


def test_ctrl_z_stops_the_whole_job_and_fg_continues_it() -> None:
    marker = job_marker()
    with Shell() as shell:
        shell.keys(" ".join([*POPRUN, "--num-instances", "2", PYTHON, TICKER, str(COUNT), "0.02", marker]) + "\n")
        stop_and_continue(shell, marker, 2)
