"""How a stub ends (``poprun_py/stub/program.py``'s ``leave``; ``_stub.c`` does the same): under
MPICH's gforker, behind a holder that keeps the descriptors gforker reads open until gforker has
reaped the stub, so that gforker never starts its final wait with a child it has not reaped (that
wait then spins for up to 2 s). And what is collected on the way: the ends of the orphans a job
leaves while it runs (issue 40).

Real processes throughout: a child Python plays the stub, the test plays its parent (or a real
gforker is its parent); each step waits for what the processes do (a pidfd, EOF on a pipe, a
process's state in /proc), never for a sleep."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from popcontract import environment
from poprun_py.shared import sweep
from tests.helpers import BIN, OMP_SET, PYTHON, ROOT, SUBPROCESS_TIMEOUT, UNDER_MUTANTS, task_state, wait_until

pytestmark = pytest.mark.slow  # every test starts a child that plays the stub, or gforker

GFORKER = BIN / "mpiexec.gforker"


def _script(code: str) -> list[str]:
    """A Python command, as mpiexec starts the Python stub (``python -S``), that imports its
    ``program`` module and runs ``code``; under ``make mutants`` it records what it reaches, as the
    stub's own script does (tests/conftest.py)."""
    prelude = f"import os, sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom poprun_py.stub import program\n"
    if UNDER_MUTANTS:
        prelude = "import sitecustomize\n" + prelude
    return [PYTHON, "-S", "-c", prelude + code]


def _child(code: str, pass_fds: tuple[int, ...] = (), env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """:func:`_script` as a child of this process, its stdin, stdout and stderr on pipes."""
    return subprocess.Popen(_script(code), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT, pass_fds=pass_fds, env=env)


def _read_by_anyone(pipe: IO[bytes]) -> bool:
    """Whether a process still holds the read end of the pipe ``pipe`` writes to (else EPIPE)."""
    try:
        os.write(pipe.fileno(), b"x")
    except BrokenPipeError:
        return False
    return True


def _exited(pid: int) -> None:
    """Wait until ``pid`` (a child of this process) has exited, without reaping it."""
    fd = os.pidfd_open(pid)
    try:
        assert select.select([fd], [], [], SUBPROCESS_TIMEOUT)[0], f"process {pid} did not exit"
    finally:
        os.close(fd)


def _at_eof(fd: int, wait: float = 0.0) -> bool:
    """Whether the pipe ``fd`` reads at its end within ``wait`` seconds (nothing is ever written to it)."""
    if not select.select([fd], [], [], wait)[0]:
        return False
    assert os.read(fd, 1) == b""
    return True


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for child in started:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=SUBPROCESS_TIMEOUT)
        for pipe in (child.stdin, child.stdout, child.stderr):
            if pipe is not None:
                pipe.close()


def test_the_holder_keeps_stdio_open_until_the_stub_is_reaped(children: list[subprocess.Popen[bytes]]) -> None:
    other_r, other_w = os.pipe()  # closed by the holder as it starts: then it has closed all it will
    try:
        child = _child("program.HOLD_LIMIT = 600\nprogram.hold_until_reaped()\nos._exit(7)", pass_fds=(other_w,))
        os.close(other_w)
        assert _at_eof(other_r, SUBPROCESS_TIMEOUT)
    finally:
        os.close(other_r)
    children.append(child)
    stdin, stdout, stderr = child.stdin, child.stdout, child.stderr
    assert stdin is not None and stdout is not None and stderr is not None
    out, err = stdout.fileno(), stderr.fileno()
    _exited(child.pid)
    assert not _at_eof(out), "stdout closed while the stub was not yet reaped"
    assert not _at_eof(err), "stderr closed while the stub was not yet reaped"
    assert _read_by_anyone(stdin), "stdin closed while the stub was not yet reaped"
    assert child.wait(timeout=SUBPROCESS_TIMEOUT) == 7  # reaped: now the holder lets go
    assert _at_eof(out, SUBPROCESS_TIMEOUT) and _at_eof(err, SUBPROCESS_TIMEOUT)
    # the holder is gone: stdin's last reader goes with it (the kernel releases a dying process's
    # files in no set order, so stdin may be the last)
    wait_until(lambda: not _read_by_anyone(stdin), "the holder kept stdin open")


def test_without_a_holder_stdout_closes_before_the_parent_can_reap(children: list[subprocess.Popen[bytes]]) -> None:
    """What gforker meets without the holder, and what leave does under any other parent."""
    child = _child("program.leave(5)")
    children.append(child)
    assert child.stdout is not None
    _exited(child.pid)
    assert _at_eof(child.stdout.fileno())  # a process's descriptors close before it is a zombie
    assert child.wait(timeout=SUBPROCESS_TIMEOUT) == 5


def test_a_holder_whose_stub_is_never_reaped_gives_up(children: list[subprocess.Popen[bytes]]) -> None:
    child = _child("program.HOLD_LIMIT = 0.01\nprogram.hold_until_reaped()\nos._exit(7)")
    children.append(child)
    assert child.stdout is not None
    _exited(child.pid)
    assert _at_eof(child.stdout.fileno(), SUBPROCESS_TIMEOUT), "the holder waited for ever"
    assert sweep.start_time(child.pid) is not None  # still a zombie, not reaped: the holder gave up
    assert child.wait(timeout=SUBPROCESS_TIMEOUT) == 7


def test_the_holder_keeps_pmi_fd_and_closes_every_other_descriptor(children: list[subprocess.Popen[bytes]]) -> None:
    pmi_r, pmi_w = os.pipe()
    other_r, other_w = os.pipe()
    try:
        child = _child("program.HOLD_LIMIT = 600\nprogram.hold_until_reaped()\nos._exit(0)", pass_fds=(pmi_w, other_w),
                       env={**os.environ, environment.PMI_FD: str(pmi_w)})
        children.append(child)
        os.close(pmi_w)
        os.close(other_w)
        _exited(child.pid)
        assert _at_eof(other_r, SUBPROCESS_TIMEOUT), "the holder kept a descriptor gforker does not read"
        assert not _at_eof(pmi_r), "the holder let PMI_FD go before the stub was reaped"
        assert child.wait(timeout=SUBPROCESS_TIMEOUT) == 0
        assert _at_eof(pmi_r, SUBPROCESS_TIMEOUT)
    finally:
        os.close(pmi_r)
        os.close(other_r)


def _marked(mark: bytes, but: int) -> list[int]:
    return [pid for pid in sweep.pids() if pid != but and sweep.holds_marks(pid, (mark,))]


@pytest.mark.skipif(not GFORKER.exists(), reason="needs MPICH's mpiexec.gforker (the mpich wheel)")
def test_under_gforker_the_stub_leaves_a_holder_until_gforker_reaps_it(tmp_path: Path) -> None:
    """gforker, stopped, cannot reap the stub: the holder waits; gforker, continued, reaps the stub,
    the holder goes, and gforker exits with the stub's status."""
    mark = f"POPRUN_TEST_HOLDER={uuid.uuid4().hex}"
    go = tmp_path / "go"
    code = (f"print(os.getpid(), flush=True)\nimport time\nwhile not os.path.exists({str(go)!r}):\n"
            "    time.sleep(0.005)\nprogram.HOLD_LIMIT = 600\nprogram.leave(3)")
    name, value = mark.split("=")
    gforker = subprocess.Popen([str(GFORKER), "-n", "1", *_script(code)], stdout=subprocess.PIPE,
                               stdin=subprocess.DEVNULL, env={**os.environ, name: value})
    try:
        assert gforker.stdout is not None
        stub_pid = int(gforker.stdout.readline())
        os.kill(gforker.pid, signal.SIGSTOP)
        wait_until(lambda: sweep.is_stopped(gforker.pid), "gforker did not stop")
        go.touch()
        wait_until(lambda: _zombie(stub_pid), "the stub did not exit")
        holders = _marked(mark.encode(), but=gforker.pid)
        assert len(holders) == 1, f"expected the stub's holder alone, found {holders}"
        os.kill(gforker.pid, signal.SIGCONT)
        assert gforker.wait(timeout=SUBPROCESS_TIMEOUT) == 3
        wait_until(lambda: not _marked(mark.encode(), but=gforker.pid), "the holder outlived gforker's wait")
    finally:
        if gforker.poll() is None:
            os.kill(gforker.pid, signal.SIGCONT)
            gforker.kill()
            gforker.wait(timeout=SUBPROCESS_TIMEOUT)
        if gforker.stdout is not None:
            gforker.stdout.close()


def _zombie(pid: int) -> bool:
    return task_state(f"/proc/{pid}") == "Z"



#: A parent of poprun that adopts orphans and, once poprun has exited, prints how many processes
#: it has as children, the ended (zombies) among them: what poprun left for it to collect.
_ADOPTER = """
import os, subprocess, sys
from poprun_py.shared import sweep
sweep.adopt_orphans()
status = subprocess.call(sys.argv[1:], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
def parent(pid):  # from /proc/PID/stat, zombie or not; None once it is gone
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rsplit(b")", 1)[1].split()[1])
    except OSError:
        return None
me = os.getpid()
left = [pid for pid in sweep.pids() if parent(pid) == me]
print(status, len(left))
"""


@pytest.mark.skipif(not GFORKER.exists(), reason="needs MPICH's mpiexec.gforker (the mpich wheel)")
def test_poprun_collects_the_holders_its_job_orphans() -> None:
    """Each stub's holder outlives its stub: poprun, the nearest subreaper above it, collects its
    end, so nothing reaches the next one up (here a subreaper of the test's, else init)."""
    from tests.helpers import POPRUN, run

    result = run([PYTHON, "-c", _ADOPTER, *POPRUN, "--num-instances", "2", PYTHON, "-c", "pass"],
                 env=OMP_SET)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "0"], result.stdout


#: The program: BATCHES times, SIZE orphans (a child forks a grandchild and exits; the stub, the
#: subreaper, adopts the grandchild), checked to be the stub's, then released to end together; it
#: waits (at most 10 s) until the stub has collected every one of them, and says so in REPORT
#: (with the most zombies it saw under the stub), then exits 3.
_ORPHANS = """
import os, sys, time
report = open(sys.argv[1], 'w', buffering=1)
batches, size = int(sys.argv[2]), int(sys.argv[3])
stub = os.getppid()

def parent(pid):
    try:
        with open(f'/proc/{pid}/stat', 'rb') as stat:
            fields = stat.read().rsplit(b')', 1)[1].split()
    except OSError:
        return None, None  # collected
    return int(fields[1]), fields[0]

def zombies():
    return sum(parent(int(name)) == (stub, b'Z') for name in os.listdir('/proc') if name.isdigit())

most = 0
for batch in range(batches):
    release_r, release_w = os.pipe()
    born_r, born_w = os.pipe()
    for _ in range(size):
        child = os.fork()
        if child == 0:
            grandchild = os.fork()
            if grandchild == 0:
                os.close(release_w)
                os.close(born_w)
                os.read(release_r, 1)  # until the batch is released
                os._exit(0)
            os.write(born_w, b'%d\\n' % grandchild)
            os._exit(0)
        os.waitpid(child, 0)  # its child is an orphan now
    os.close(born_w)
    born = b''
    while born.count(b'\\n') < size:
        born += os.read(born_r, 4096)
    os.close(born_r)
    orphans = [int(pid) for pid in born.split()]
    if any(parent(pid)[0] != stub for pid in orphans):
        report.write('not adopted by the stub\\n')
        sys.exit(4)
    os.close(release_r)
    os.close(release_w)  # every orphan of the batch ends now
    deadline = time.monotonic() + 10
    while (left := sum(parent(pid)[0] == stub for pid in orphans)):
        most = max(most, zombies())
        if time.monotonic() > deadline:
            report.write(f'batch {batch}: {left} of {size} orphans not collected\\n')
            sys.exit(1)
        time.sleep(0.001)
    report.write(f'batch {batch} collected\\n')
report.write(f'most zombies {most}\\n')
sys.exit(3)
"""


def test_the_stub_collects_orphans_as_they_end(tmp_path: Path) -> None:
    """300 orphans, in batches of 25, end while the job runs: the stub collects each batch before
    the next is made (the zombies under it never pile up), the program's status is still exactly
    its own, and nothing is left for the process above poprun to collect."""
    from tests.helpers import POPRUN, run

    report = tmp_path / "report"
    batches, size = 12, 25
    result = run([PYTHON, "-c", _ADOPTER, *POPRUN, "--num-instances", "1", PYTHON, "-c", _ORPHANS, str(report),
                  str(batches), str(size)], env=OMP_SET)
    lines = report.read_text().splitlines()
    assert lines[:-1] == [f"batch {batch} collected" for batch in range(batches)], (lines, result.stderr)
    assert 0 <= int(lines[-1].removeprefix("most zombies ")) <= size
    assert result.stdout.split() == ["3", "0"], (result.stdout, result.stderr)
