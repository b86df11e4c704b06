"""What the multi-host tests share: the cluster (``tests/cluster.py``), built once per test module,
and the check after each test that nothing of the job is left on any host. What the distribution's
tests share: ``make dist``'s output and the fresh venvs that install it, made once per session
(``tests/integration/distribution.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import NETWORK_ENV, Cluster, unavailable_reason
from tests.conftest import LOUD
from tests.helpers import MPICH_MPIEXEC, OPENMPI_LIBMPI, OPENMPI_MPIEXEC, POPRUN, ROOT
from tests.integration.distribution import (
    INSTALL_TIMEOUT,
    Dist,
    Installed,
    compiler_free_env,
    fill_wheelhouse,
    install_command,
    make_dist,
)

MPIEXEC = {"mpich": MPICH_MPIEXEC, "openmpi": OPENMPI_MPIEXEC}
#: A host failure must end the job within this bound (ssh's ConnectTimeout is 10 s).
FAILURE_BOUND = 30.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    reason = unavailable_reason()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"the multi-host tests must run in CI, but the cluster cannot be built: {reason}")
        pytest.skip(f"{LOUD}: {reason}")
    with Cluster(3, networks=2) as built:
        yield built


#: How long a process on a host that was cut off may take to end once the host is back: one that
#: had sent data its peer never acknowledged (Open MPI's daemon, when the partition came in the
#: middle of an exchange) learns that its peer is gone only from the answer to its next
#: retransmission, which Linux's backoff puts up to TCP_RTO_MAX (120 s) after the previous one.
BACK_ON_THE_NETWORK = 130


@pytest.fixture
def nothing_left(cluster: Cluster) -> Iterator[None]:
    """After each test: no process on any host (its listening sshd aside); hosts come back. The
    multi-host modules use it for every test (``pytest.mark.usefixtures``)."""
    yield
    cut = [host for host in cluster.hosts if host.was_cut]
    for host in cluster.hosts:  # a host cut off cannot be cleaned until it is back on the network
        cluster.set_link(host, up=True)
        host.was_cut = False
    left = cluster.leftovers(within=BACK_ON_THE_NETWORK if cut else 10)
    for host in cluster.hosts:
        cluster.restore(host)
    assert left == {}, f"processes left on the hosts: {left}"


def mpi_args(mpi: str) -> list[str]:
    return ["--mpi", str(MPIEXEC[mpi])]


def job_env(mpi: str, **extra: str) -> dict[str, str]:
    env = {**NETWORK_ENV, **extra}
    if mpi == "openmpi":
        env["MPI4PY_LIBMPI"] = str(OPENMPI_LIBMPI)
    return env


def start_poprun(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([*POPRUN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env}, cwd=ROOT)


def wait_started(proc: subprocess.Popen[str], count: int) -> None:
    """Block until every instance has said it started (ordered by their messages, not a sleep)."""
    assert proc.stdout is not None
    started = 0
    while started < count:
        line = proc.stdout.readline()
        assert line, f"poprun ended before {count} instances started: {proc.communicate(timeout=30)}"
        started += "started" in line


#: What MPI and poprun leave in a host's /tmp and /dev/shm when their processes are killed.
JOB_FILE_PREFIXES = ("hydra_hwloc_xmlfile_", "mpich_shm_", "ompi.", "prte.", "prted.", "poprun-", "pmix")


def job_files(cluster: Cluster, name: str) -> list[str]:
    """The files of MPI and poprun in the host's own /tmp and /dev/shm (read over ssh: a shell
    there is in the host's mount namespace)."""
    listed = cluster.ssh(cluster.host(name), "ls -A /tmp /dev/shm").stdout.split()
    return sorted(entry for entry in listed if entry.startswith(JOB_FILE_PREFIXES))


# -- the distribution ----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def dist_top() -> Iterator[Path]:
    """The session's folder of ``make dist``'s output and the fresh venvs, removed at its end;
    ``away`` in it is a working directory outside the checkout, and ``cc.log`` what the failing
    CC was asked to compile."""
    with tempfile.TemporaryDirectory(prefix="poprun-dist-") as top:
        assert not Path(top).is_relative_to(ROOT)
        (Path(top) / "away").mkdir()
        yield Path(top)


@pytest.fixture(scope="session")
def dist(dist_top: Path) -> Dist:
    return make_dist(dist_top / "dist")


@pytest.fixture(scope="session")
def installing(dist: Dist, dist_top: Path) -> dict[str, tuple[Installed, int]]:
    """The wheel with the examples extra (the MNIST demo trains from it) and the sdist without
    (the demo refuses before it reads its data), each into a fresh venv with no compiler reachable,
    at once (two pip processes on two cores), their dependencies from the wheelhouse alone:
    ``{"wheel" | "sdist": (the install, pip's exit status)}``."""
    wheelhouse = fill_wheelhouse(dist_top)
    venvs = {kind: dist_top / f"venv-{kind}" for kind in ("wheel", "sdist")}
    envs = {kind: compiler_free_env(dist_top, venv) for kind, venv in venvs.items()}
    for venv in venvs.values():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=INSTALL_TIMEOUT)
    extras = {"wheel": "[examples]", "sdist": ""}
    procs = {kind: subprocess.Popen([str(c) for c in install_command(venv, getattr(dist, kind), wheelhouse,
                                                                     extras[kind])],
                                    cwd=dist_top / "away", env=envs[kind], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
             for kind, venv in venvs.items()}
    done = {}
    try:
        for kind, proc in procs.items():
            log = proc.communicate(timeout=INSTALL_TIMEOUT)[0]
            done[kind] = (Installed(venvs[kind], envs[kind], log), proc.returncode)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def _installed(installing: dict[str, tuple[Installed, int]], kind: str) -> Installed:
    installed, status = installing[kind]
    assert status == 0, f"installing the {kind} with no compiler exited {status}:\n{installed.log[-3000:]}"
    return installed


@pytest.fixture(scope="session")
def wheel_install(installing: dict[str, tuple[Installed, int]]) -> Installed:
    """``make dist``'s wheel installed where no compiler is."""
    return _installed(installing, "wheel")


@pytest.fixture(scope="session")
def sdist_install(installing: dict[str, tuple[Installed, int]]) -> Installed:
    """``make dist``'s sdist installed where no compiler is: built without its compiled parts."""
    return _installed(installing, "sdist")


def lines_with(proc: subprocess.Popen[str], prefix: str, count: int) -> list[str]:
    """The next ``count`` lines of poprun's stdout that hold ``prefix`` (ordered by the messages)."""
    assert proc.stdout is not None
    found: list[str] = []
    while len(found) < count:
        line = proc.stdout.readline()
        assert line, f"poprun ended before {count} lines with {prefix!r}: {found} {proc.communicate(timeout=30)}"
        if prefix in line:
            found.append(line.rstrip("\n"))
    return sorted(found)
