"""Jobs past what MPICH's gforker (poprun's pick for one host) can start run on one host, on
loopback only: hundreds of program arguments, one of 64 KiB, and 256 and 1,024 instances of a
trivial program, each instance with its own exact environment, every one reporting.

gforker ignores the config file a command longer than 64 KiB (about 200 instances) needs: given
one it started nothing and exited 0 ("mpiexec exited with status 0 before instance(s) 0-255
reported"). Such a job goes to Hydra's mpiexec, kept on loopback by poprun's library."""

from __future__ import annotations

import hashlib
import os
import resource
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from popcontract import environment
from poprun_py.shared import loopback
from poprun_py.supervision.launch import FILES_MARGIN, FILES_PER_LOCAL_INSTANCE
from tests.helpers import BIN, OMP_SET, POPRUN, PYTHON, ROOT, SUBPROCESS_TIMEOUT
from tests.launcher.test_network_exposure import (
    _beyond_loopback,
    _descendants,
    _open_to,
    _poprun_without_the_library,
    _socket_inodes,
)

pytestmark = pytest.mark.slow  # every test starts poprun

#: The program's arguments, how many and how long, and the launcher above its stub (the stub's
#: parent's executable), in one line.
SHOW = ("import hashlib, os, sys\n"
        "stub = open(f'/proc/{os.getppid()}/stat').read().rsplit(')', 1)[1].split()[1]\n"
        "launcher = os.path.basename(os.readlink(f'/proc/{stub}/exe'))\n"
        "args = [os.fsencode(a) for a in sys.argv[1:]]\n"
        "print(len(args), max(map(len, args)), hashlib.sha256(b'\\0'.join(args)).hexdigest(), launcher)\n")
#: What differs between instances, as the program sees it.
PER_INSTANCE = (environment.INSTANCE_INDEX, environment.LOCAL_INSTANCE_INDEX, environment.REPLICA_INDEX_OFFSET,
                environment.RANK, environment.LOCAL_RANK, environment.TORCHELASTIC_ERROR_FILE)
PRINTENV = shutil.which("printenv") or "/usr/bin/printenv"


def _poprun(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*POPRUN, *args], capture_output=True, text=True, cwd=ROOT, timeout=SUBPROCESS_TIMEOUT,
                          env={**os.environ, **OMP_SET})


@pytest.mark.parametrize("args", [[f"a{i}" for i in range(300)], ["x" * 65536]], ids=["300-arguments", "64KiB"])
def test_hundreds_of_arguments_and_a_long_one_reach_every_instance_under_gforker(args: list[str]) -> None:
    """gforker refuses more than 254 arguments for a program ("requested=305 maximum=256"), and an
    argument of 64 KiB once pushed the command into its ignored config file: neither is gforker's
    to read any more (the stub gets them from poprun)."""
    digest = hashlib.sha256(b"\0".join(os.fsencode(a) for a in args)).hexdigest()
    result = _poprun("--num-instances", "2", PYTHON, "-c", SHOW, *args)
    assert result.returncode == 0, result.stderr[-2000:]
    line = f"{len(args)} {max(map(len, args))} {digest} mpiexec.gforker"
    assert sorted(result.stdout.splitlines()) == [f"[0] {line}", f"[1] {line}"], result.stdout[-2000:]


def test_256_instances_run_on_one_host_each_with_its_environment_on_loopback_only(tmp_path: Path) -> None:
    """Every instance opens a FIFO that the test holds open, says its own variables and waits for
    the FIFO's end: once all have spoken, every socket of every process of the job is on loopback."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    held = os.open(fifo, os.O_RDWR)  # a writer: the instances' opens return at once, their reads wait
    shown = " ".join(f"${{{name}}}" for name in PER_INSTANCE)
    program = f"exec 3< {shlex.quote(str(fifo))}; echo {shown}; read line <&3; exit 0"
    proc = subprocess.Popen([*POPRUN, "--num-instances", "256", "/bin/sh", "-c", program], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, **OMP_SET})
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(256)]
        opened = _open_to(set().union(*(_socket_inodes(pid) for pid in _descendants(proc.pid))))
        os.close(held)
        held = -1
        out, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    finally:
        proc.kill()
        if held >= 0:
            os.close(held)
    assert proc.returncode == 0 and out == "", err[-2000:]
    said = dict(line.rstrip("\n").split(" ", 1) for line in lines)
    error_files = {value.split()[-1] for value in said.values()}
    assert len(error_files) == 256  # each its own, in the job's one directory
    directory = os.path.dirname(next(iter(error_files)))
    assert said == {f"[{i}]": f"{i} {i} {i} {i} {i} {directory}/error-{i}.json" for i in range(256)}
    assert any(entry.startswith("127.0.0.1:") for entry in opened), opened  # poprun's port, at least
    assert _beyond_loopback(opened) == [], opened


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hard_limit", [None, 4096], ids=["this-systems-hard-limit", "hard-limit-4096"])
def test_1024_instances_run_on_one_host_with_the_open_file_limit_raised_and_bounded_memory(
        hard_limit: int | None) -> None:
    """1,024 instances of a trivial program on one host, started with a soft open-file limit of
    1,024 (mpiexec's proxy needs about 4 descriptors per instance: poprun raises the soft limit to
    the hard one): every instance reports, and poprun and its processes stay small. On 2 cores
    this takes about a minute (the stubs' start-up: ~0.1 s of CPU each). Where the hard limit is
    too low, the job is refused in one line naming it."""
    hard = hard_limit or resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    need = FILES_PER_LOCAL_INSTANCE * 1024 + FILES_MARGIN

    def low_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

    # poprun under a parent of its own, which says the largest of its and its processes' peak
    # resident sizes (the children's ru_maxrss: poprun's, or that of one it collected) at the end.
    measure = ("import resource, subprocess, sys\n"
               "status = subprocess.run(sys.argv[1:]).returncode\n"
               "print('maxrss', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
               "sys.exit(status)\n")
    result = subprocess.run([PYTHON, "-c", measure, *POPRUN, "--num-instances", "1024", PRINTENV,
                             environment.INSTANCE_INDEX], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, **OMP_SET}, preexec_fn=low_soft_limit, timeout=240)
    *said, last = result.stderr.splitlines()
    if hard != resource.RLIM_INFINITY and hard < need:  # refused, before anything starts, in one line
        assert (result.returncode, result.stdout) == (2, ""), result
        assert said == [(f"poprun: error: 1024 instances on one host need about {need} open files in mpiexec's "
                         f"process there, more than this system allows ({hard}, ulimit -Hn); start fewer "
                         "instances per host, or raise the limit")], said
        return
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(result.stdout.splitlines()) == sorted(f"[{i}] {i}" for i in range(1024))
    assert said == [], said[-20:]
    maxrss_kib = int(last.removeprefix("maxrss "))
    assert maxrss_kib < 100 * 1024, last


def test_a_job_too_large_for_gforker_named_by_the_user_is_refused_in_one_line(tmp_path: Path) -> None:
    """poprun starts a job too large for gforker's command line with Hydra itself; when the user
    names gforker, it says so before anything starts instead of starting nothing."""
    ran = tmp_path / "ran"
    result = _poprun("--mpi", str(BIN / "mpiexec.gforker"), "--num-instances", "256", "/bin/sh", "-c",
                     f"touch {shlex.quote(str(ran))}")
    assert (result.returncode, result.stdout) == (2, ""), result
    assert result.stderr == (f"poprun: error: {BIN / 'mpiexec.gforker'} cannot start this job: its command would be "
                             "longer than 64 KiB, and gforker ignores the config file that would take it; pass --mpi "
                             "with Hydra's mpiexec instead\n")
    assert not ran.exists()


def test_the_dry_run_of_a_job_too_large_for_gforker_shows_hydra_kept_on_loopback() -> None:
    env = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}
    result = subprocess.run([*POPRUN, "--dry-run", "--num-instances", "256", "/bin/true"], capture_output=True,
                            text=True, cwd=ROOT, env={**env, **OMP_SET}, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    (mpi,) = [line for line in lines if line.startswith("mpi: ")]
    assert mpi.startswith("mpi: mpich ") and mpi.endswith(f" ({BIN / 'mpiexec'})"), mpi  # not gforker
    assert f"environment: LD_PRELOAD={loopback.library()}" in lines, lines
    command = shlex.split(next(line for line in lines if line.startswith("command: "))[9:])
    assert command[:3] == [str(BIN / "mpiexec"), "-localhost", "127.0.0.1"], command
    assert command[-2] == "-configfile" and "<config-file>: 256 lines (the command line would be too long)" in lines


def test_a_job_too_large_for_gforker_is_refused_in_one_line_where_hydras_library_is_missing(tmp_path: Path) -> None:
    """Hydra would listen on every interface without poprun's loopback library: a job that only
    Hydra can start is refused, before anything starts, rather than run exposed."""
    ran = tmp_path / "ran"
    result = _poprun_without_the_library(tmp_path, "--num-instances", "256", "/bin/sh", "-c",
                                         f"touch {shlex.quote(str(ran))}")
    assert (result.returncode, result.stdout) == (2, ""), result
    assert result.stderr.count("\n") == 1 and "would listen on every interface" in result.stderr, result.stderr
    assert not ran.exists()


def test_an_environment_too_large_for_gforker_goes_to_hydra_or_is_refused_when_gforker_is_named(tmp_path: Path) -> None:
    """gforker passes on at most 192 variables of its environment ("Environment is too large (max
    is 193)" from every instance, which then never started): with more, poprun's own pick is
    Hydra's mpiexec, and a user who named gforker is told so before anything starts."""
    extra = {f"POPRUN_TEST_EXTRA_{i}": str(i) for i in range(200)}
    env = {**os.environ, **OMP_SET, **extra}
    result = subprocess.run([*POPRUN, "--num-instances", "2", PRINTENV, "POPRUN_TEST_EXTRA_199",
                             environment.INSTANCE_INDEX], capture_output=True, text=True, cwd=ROOT, env=env,
                            timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(result.stdout.splitlines()) == ["[0] 0", "[0] 199", "[1] 1", "[1] 199"], result.stdout
    ran = tmp_path / "ran"
    result = subprocess.run([*POPRUN, "--mpi", str(BIN / "mpiexec.gforker"), "--num-instances", "2", "/bin/sh", "-c",
                             f"touch {shlex.quote(str(ran))}"], capture_output=True, text=True, cwd=ROOT, env=env,
                            timeout=SUBPROCESS_TIMEOUT)
    assert (result.returncode, result.stdout) == (2, ""), result
    variables = len(env.keys() | {environment.SECRET})
    assert result.stderr == (f"poprun: error: {BIN / 'mpiexec.gforker'} cannot start this job: its environment would "
                             f"have {variables} variables, and gforker passes on 192 at most; pass --mpi with Hydra's "
                             "mpiexec instead\n")
    assert not ran.exists()
