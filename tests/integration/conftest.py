"""What the multi-host tests share: the cluster (``tests/cluster.py``), built once per test module,
and the check after each test that nothing of the job is left on any host."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from tests.cluster import NETWORK_ENV, Cluster, unavailable_reason
from tests.conftest import LOUD
from tests.helpers import MPICH_MPIEXEC, OPENMPI_LIBMPI, OPENMPI_MPIEXEC, POPRUN, ROOT

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


@pytest.fixture
def nothing_left(cluster: Cluster) -> Iterator[None]:
    """After each test: no process on any host (its listening sshd aside); hosts come back. The
    multi-host modules use it for every test (``pytest.mark.usefixtures``)."""
    yield
    for host in cluster.hosts:  # a host cut off cannot be cleaned until it is back on the network
        cluster.set_link(host, up=True)
    left = cluster.leftovers(within=10)
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
