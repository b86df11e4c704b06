"""The last check of every sweep (poprun_py.shared.sweep), on real processes: a kill reaches only a
process that is, when pinned, what the sweep looks for."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from poprun_py.shared import sweep


def _sleeper(*, env: dict[str, str] | None = None, new_session: bool = False) -> subprocess.Popen[bytes]:
    """``sleep 60``, returned once its environment can be read: Popen returns when the exec has
    begun, and until the kernel has set the new program's stack up /proc/PID/environ reads empty."""
    process = subprocess.Popen(["sleep", "60"], env=env, start_new_session=new_session)
    deadline = time.monotonic() + 10
    while env and not Path(f"/proc/{process.pid}/environ").read_bytes():
        assert time.monotonic() < deadline, "sleep never finished its exec"
        time.sleep(0.001)
    return process


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def _killed(process: subprocess.Popen[bytes]) -> bool:
    return process.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.slow  # starts processes
def test_a_member_of_the_session_is_killed_and_nothing_outside_it(processes: list[subprocess.Popen[bytes]]) -> None:
    leader, member = _sleeper(new_session=True), _sleeper()  # member: this test's own session
    processes += [leader, member]
    assert sweep.in_session(leader.pid, leader.pid) and not sweep.in_session(member.pid, leader.pid)
    assert not sweep.kill_in_session(member.pid, leader.pid)
    assert member.poll() is None
    assert sweep.kill_in_session(leader.pid, leader.pid) and _killed(leader)
    assert not sweep.in_session(leader.pid, leader.pid)  # reaped: gone
    assert not sweep.kill_in_session(leader.pid, leader.pid)


@pytest.mark.slow  # starts processes
def test_neither_a_zombie_nor_the_caller_itself_counts_or_is_killed(processes: list[subprocess.Popen[bytes]]) -> None:
    leader = _sleeper(new_session=True)
    processes.append(leader)
    os.kill(leader.pid, signal.SIGKILL)
    os.waitid(os.P_PID, leader.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped: a zombie
    assert sweep.pids().count(leader.pid) == 1
    assert not sweep.in_session(leader.pid, leader.pid) and not sweep.kill_in_session(leader.pid, leader.pid)
    own = os.getsid(0)
    assert not sweep.in_session(os.getpid(), own) and not sweep.kill_in_session(os.getpid(), own)
    marks = tuple(f"{name}={value}".encode() for name, value in list(os.environ.items())[:2])
    assert not sweep.holds_marks(os.getpid(), marks) and not sweep.kill_leftover(os.getpid(), 0, marks)


def test_pids_below_two_are_never_signalled() -> None:
    for pid in (-1, 0, 1):
        assert not sweep.kill_in_session(pid, os.getsid(1) if pid == 1 else 0)
        assert not sweep.kill_leftover(pid, 0, (b"PATH=" + os.environ["PATH"].encode(),))


@pytest.mark.slow  # starts processes
def test_marks_are_whole_entries_of_the_environment_and_all_of_them_count(
        processes: list[subprocess.Popen[bytes]]) -> None:
    marked = _sleeper(env={"JOB": "a1", "INDEX": "3", "OTHER": "xJOB=a1"})
    processes.append(marked)
    assert sweep.holds_marks(marked.pid, (b"JOB=a1", b"INDEX=3"))
    assert sweep.holds_marks(marked.pid, (b"INDEX=3",))  # the last entry too
    for marks in [(b"JOB=a1", b"INDEX=4"), (b"JOB=a",), (b"OB=a1",), (b"INDEX=",), ()]:
        assert not sweep.holds_marks(marked.pid, marks), marks
        assert not sweep.kill_leftover(marked.pid, 0, marks), marks
    assert marked.poll() is None
    assert sweep.kill_leftover(marked.pid, 0, (b"JOB=a1", b"INDEX=3")) and _killed(marked)
    assert not sweep.kill_leftover(marked.pid, 0, (b"JOB=a1",))  # gone


@pytest.mark.slow  # starts processes
def test_a_marked_zombie_holds_no_marks(processes: list[subprocess.Popen[bytes]]) -> None:
    # Its environment is read first (holds_marks): a dead process must not pass on what /proc kept.
    marked = _sleeper(env={"JOB": "a1"})
    processes.append(marked)
    os.kill(marked.pid, signal.SIGKILL)
    os.waitid(os.P_PID, marked.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped: a zombie
    assert not sweep.holds_marks(marked.pid, (b"JOB=a1",)) and not sweep.kill_leftover(marked.pid, 0, (b"JOB=a1",))


@pytest.mark.slow  # starts processes
def test_descendants_are_found_through_every_generation_and_only_they_are_killed(
        processes: list[subprocess.Popen[bytes]]) -> None:
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE)
    processes.append(parent)
    assert parent.stdout is not None
    grandchild = int(parent.stdout.readline())
    outsider = _sleeper(new_session=True)
    processes.append(outsider)
    me = os.getpid()
    assert {parent.pid, grandchild} <= set(sweep.descendants(me)) and outsider.pid in sweep.descendants(me)
    assert sweep.descendants(parent.pid) == [grandchild]
    assert sweep.descends_from(grandchild, parent.pid) and sweep.descends_from(grandchild, me)
    assert not sweep.descends_from(parent.pid, grandchild) and not sweep.descends_from(outsider.pid, parent.pid)
    assert not sweep.kill_leftover(outsider.pid, parent.pid) and outsider.poll() is None
    assert not sweep.kill_leftover(me, os.getppid())  # never the caller itself
    assert sweep.kill_leftover(grandchild, parent.pid)
    assert parent.wait(timeout=10) == 0  # its `wait` returned: the sleep is gone
    assert sweep.descendants(parent.pid) == []


@pytest.mark.slow  # starts processes
def test_leftovers_are_below_the_root_or_marked_and_never_what_is_spared(
        processes: list[subprocess.Popen[bytes]]) -> None:
    """A teardown's sweep during the job spares mpiexec and what runs below it (``spare``), and
    ends what else is below poprun or, where poprun is no subreaper, marked."""
    spared = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE)
    processes.append(spared)
    assert spared.stdout is not None
    below_spared = int(spared.stdout.readline())
    left = _sleeper(new_session=True)
    marked = _sleeper(env={"PATH": os.environ["PATH"], "JOB": "a1"}, new_session=True)
    processes += [left, marked]
    me, marks = os.getpid(), (b"JOB=a1",)
    found = sweep.leftovers(me, spare=spared.pid)
    assert left.pid in found and marked.pid in found and not {spared.pid, below_spared} & set(found)
    assert {spared.pid, below_spared, left.pid} <= set(sweep.leftovers(me))
    assert marked.pid in sweep.leftovers(spared.pid, marks) and left.pid not in sweep.leftovers(spared.pid, marks)
    for pid in (spared.pid, below_spared):
        assert not sweep.kill_leftover(pid, me, marks, spare=spared.pid)
    assert not sweep.kill_leftover(left.pid, spared.pid, marks) and left.poll() is None  # neither below nor marked
    assert not sweep.kill_leftover(me, os.getppid())  # never the caller itself
    assert sweep.kill_leftover(marked.pid, spared.pid, marks) and _killed(marked)
    assert sweep.kill_leftover(left.pid, me, spare=spared.pid) and _killed(left)
    assert spared.poll() is None


@pytest.mark.slow  # starts processes
def test_a_stopped_process_is_told_from_a_running_one_and_a_zombie(processes: list[subprocess.Popen[bytes]]) -> None:
    sleeper = _sleeper()
    processes.append(sleeper)
    assert not sweep.is_stopped(sleeper.pid)
    os.kill(sleeper.pid, signal.SIGSTOP)
    os.waitid(os.P_PID, sleeper.pid, os.WSTOPPED | os.WNOWAIT)  # stopped by now (the state says T)
    assert sweep.is_stopped(sleeper.pid)
    os.kill(sleeper.pid, signal.SIGKILL)
    os.waitid(os.P_PID, sleeper.pid, os.WEXITED | os.WNOWAIT)
    assert not sweep.is_stopped(sleeper.pid)  # a zombie


@pytest.mark.slow  # starts processes
def test_a_start_time_lasts_while_the_process_is_a_zombie_and_ends_when_it_is_reaped(
        processes: list[subprocess.Popen[bytes]]) -> None:
    first = _sleeper()
    processes.append(first)
    born = sweep.start_time(first.pid)
    assert born is not None and born.isdigit()
    assert sweep.start_time(os.getpid()) != born  # this process started before it
    os.kill(first.pid, signal.SIGKILL)
    os.waitid(os.P_PID, first.pid, os.WEXITED | os.WNOWAIT)  # a zombie: still there
    assert sweep.start_time(first.pid) == born
    assert _killed(first)  # reaped: gone
    assert sweep.start_time(first.pid) is None


#: Run in a process of its own, whose children are only its own: the reaping collects any ended child.
_CHILDREN_SCRIPT = """
import os, signal, sys
from poprun_py.shared import sweep
me = os.getpid()
print(sweep.has_children(), sweep.descendants(me), sweep.reap_adopted())
ended = [os.posix_spawnp("true", ["true"], os.environ) for _ in range(2)]
alive = os.posix_spawnp("sleep", ["sleep", "60"], os.environ)
for pid in ended:
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # ended, not collected: zombies
print(sweep.has_children(), alive in sweep.descendants(me), sweep.reap_adopted(), sweep.reap_adopted())
print(sweep.has_children(), os.waitid(os.P_PID, alive, os.WEXITED | os.WNOHANG) is None)  # the sleep is left
os.kill(alive, signal.SIGKILL)
os.waitid(os.P_PID, alive, os.WEXITED | os.WNOWAIT)
print(sweep.reap_adopted(), sweep.has_children(), sweep.descendants(me))
"""


@pytest.mark.slow  # starts processes
def test_children_ended_are_collected_and_a_process_without_children_has_no_descendants() -> None:
    result = subprocess.run([sys.executable, "-c", _CHILDREN_SCRIPT], capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["False [] 0", "True True 2 0", "True True", "1 False []"]
