"""A job on one host opens nothing beyond loopback, whichever launcher runs it: every socket its
processes listen on (TCP) or have bound (UDP), read from /proc while the job runs, is on
127.0.0.0/8 or ::1; a launcher that would listen on every interface without poprun's loopback
library is refused where the library is missing."""

from __future__ import annotations

import ipaddress
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from popcontract import compiled
from poprun_py.shared import leftovers, loopback
from tests.helpers import (
    MPICH_MPIEXEC,
    OMP_SET,
    OPENMPI_LIBMPI,
    OPENMPI_MPIEXEC,
    POPRUN,
    PYTHON,
    ROOT,
    SUBPROCESS_TIMEOUT,
    install_without,
)

# Every instance has joined MPI (and its sockets are open) when it prints; then it waits for the file.
PROGRAM = ("import os, sys, time, numpy as np, popdist_py\n"
           "popdist_py.init(); popdist_py.allreduce(np.ones(2))\n"
           "print('ready', flush=True)\n"
           "give_up = time.monotonic() + 60\n"
           "while not os.path.exists(sys.argv[1]) and time.monotonic() < give_up: time.sleep(0.01)\n")


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it, by parent PID."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _socket_inodes(pid: int) -> set[str]:
    try:
        return {target[8:-1] for target in leftovers.open_files(pid) if target.startswith("socket:[")}
    except OSError:
        return set()  # gone


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net's ``ADDRESS:PORT`` (the address in the kernel's byte order, 32 bits at a time)."""
    raw = bytes.fromhex(hex_address.split(":")[0])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _open_to(inodes: set[str]) -> list[str]:
    """``address:port (table)`` of each of ``inodes`` that listens (TCP) or is bound (UDP)."""
    found = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if inode in inodes and (state == "0A" or table.startswith("udp")):  # 0A: LISTEN
                found.append(f"{_address(local)}:{int(local.split(':')[1], 16)} ({table})")
    return found


def _beyond_loopback(opened: list[str]) -> list[str]:
    def loopback(entry: str) -> bool:
        address = ipaddress.ip_address(entry.rsplit(":", 1)[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return address.is_loopback

    return [entry for entry in opened if not loopback(entry)]


#: Every way a one-host job can be started, with the names (/proc/PID/comm) of launcher processes
#: that show it was: poprun's own pick (MPICH's gforker), Hydra's mpiexec, which every option
#: that speaks to a particular mpiexec takes poprun to, as do hosts that are all this one, and
#: Open MPI.
LAUNCHER_PATHS: dict[str, tuple[list[str], set[str]]] = {
    "gforker": ([], {"mpiexec.gforker"}),
    "hydra --mpi": (["--mpi", str(MPICH_MPIEXEC)], {"mpiexec", "hydra_pmi_proxy"}),
    "hydra --numa-aware": (["--numa-aware", "yes"], {"mpiexec", "hydra_pmi_proxy"}),
    "hydra --mpi-global-args": (["--mpi-global-args", "-genv POPRUN_TEST_GLOBAL 1"], {"mpiexec", "hydra_pmi_proxy"}),
    "hydra --mpi-local-args": (["--mpi-local-args", "-env POPRUN_TEST_LOCAL 1"], {"mpiexec", "hydra_pmi_proxy"}),
    "hydra --instance-mpi-local-args": (["--instance-mpi-local-args", "1:-env POPRUN_TEST_LOCAL 1"],
                                        {"mpiexec", "hydra_pmi_proxy"}),
    "hydra --host localhost": (["--host", "localhost"], {"mpiexec", "hydra_pmi_proxy"}),
    "openmpi": (["--mpi", str(OPENMPI_MPIEXEC)], {"prterun"}),
}


def _job_sockets(path: str, tmp_path: Path) -> dict[str, list[str]]:
    """What each process of a running two-instance one-host job started by ``path`` (of
    ``LAUNCHER_PATHS``) listens on (or has bound), by ``PID command``; the job ran to status 0."""
    go = tmp_path / "go"
    args, launchers = LAUNCHER_PATHS[path]
    env = {"MPI4PY_LIBMPI": str(OPENMPI_LIBMPI)} if path == "openmpi" else {}
    proc = subprocess.Popen([*POPRUN, *args, "--num-instances", "2", PYTHON, "-c", PROGRAM, str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, **OMP_SET, **env})
    try:
        assert proc.stdout is not None
        ready = [proc.stdout.readline(), proc.stdout.readline()]
        assert sorted(ready) == ["[0] ready\n", "[1] ready\n"], proc.communicate(timeout=SUBPROCESS_TIMEOUT)
        opened = {}
        for pid in _descendants(proc.pid):
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue  # gone
            opened[f"{pid} {name}"] = _open_to(_socket_inodes(pid))
        go.touch()
        _, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert any(entry.startswith("127.0.0.1:") for entry in opened[f"{proc.pid} python"]), opened  # poprun's port
    assert launchers <= {who.split(" ", 1)[1] for who in opened}, (path, opened)  # the path it meant to take
    return opened


#: The launchers of Open MPI (prterun is what its mpiexec execs, prted its daemon).
OPENMPI_LAUNCHERS = ("prterun", "prted", "mpiexec", "mpirun")


@pytest.mark.slow  # starts poprun
@pytest.mark.parametrize("path", ["gforker", "openmpi"])
def test_a_one_host_jobs_instances_listen_on_loopback_only(path: str, tmp_path: Path) -> None:
    opened = _job_sockets(path, tmp_path)
    instances = {who: entries for who, entries in opened.items() if who.split()[1] not in OPENMPI_LAUNCHERS}
    assert _beyond_loopback([entry for entries in instances.values() for entry in entries]) == [], opened


@pytest.mark.slow  # starts poprun
@pytest.mark.parametrize("path", LAUNCHER_PATHS)
def test_a_one_host_job_listens_on_loopback_only(path: str, tmp_path: Path) -> None:
    """Every process of the job, launchers included, whichever launcher starts it: Hydra's mpiexec
    and Open MPI's prterun would listen on every interface but for poprun's loopback library."""
    opened = _job_sockets(path, tmp_path)
    assert _beyond_loopback([entry for entries in opened.values() for entry in entries]) == [], opened


@pytest.mark.slow  # starts poprun
@pytest.mark.parametrize("path", ["hydra --mpi", "openmpi"])
@pytest.mark.parametrize("users", [None, "libm.so.6"])
def test_the_launchers_library_stays_out_of_the_programs_environment(path: str, users: str | None) -> None:
    """poprun preloads its library into Hydra's and Open MPI's launchers on one host (that is what
    keeps them on loopback, above); the program gets LD_PRELOAD as its user set it, or not at all."""
    env = {**os.environ, **OMP_SET, "MPI4PY_LIBMPI": str(OPENMPI_LIBMPI)}
    env.pop("LD_PRELOAD", None)
    if users:
        env["LD_PRELOAD"] = users
    code = "import json, os; print(json.dumps(os.environ.get('LD_PRELOAD')))"
    result = subprocess.run([*POPRUN, *LAUNCHER_PATHS[path][0], "--num-instances", "2", PYTHON, "-c", code],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[{i}] {json.dumps(users)}" for i in range(2)], result.stdout


@pytest.mark.slow  # starts poprun
def test_hydras_proxies_call_back_on_loopback() -> None:
    """A proxy that calls Hydra's mpiexec back over TCP must find it where the library keeps it:
    on loopback, whatever this host's name resolves to (the dry run shows what will run)."""
    env = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}
    result = subprocess.run([*POPRUN, "--dry-run", "--mpi", str(MPICH_MPIEXEC), "--num-instances", "2", "/bin/true"],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert f"environment: LD_PRELOAD={loopback.library()}" in result.stdout.splitlines(), result.stdout
    command = shlex.split(next(line for line in result.stdout.splitlines() if line.startswith("command: "))[9:])
    assert command[1:3] == ["-localhost", "127.0.0.1"], command


@pytest.mark.slow  # starts poprun
def test_the_users_own_localhost_is_the_one_hydra_gets() -> None:
    """Hydra refuses a second -localhost: one in --mpi-global-args stands alone."""
    result = subprocess.run([*POPRUN, "--mpi-global-args", "-localhost 127.0.0.1", "--num-instances", "2",
                             PYTHON, "-c", "print('ran')"], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, **OMP_SET}, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0] ran", "[1] ran"], result


def _poprun_without_the_library(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """poprun ``args`` from a copy of the package whose loopback library is missing (as where it
    was never built, or was removed), run where that copy is the one Python imports."""
    copy = tmp_path / "install"
    without = install_without(copy, compiled.LOOPBACK)
    # OMP_NUM_THREADS unset: a launch that went on would say so on stderr (the refusal comes first).
    env = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
    return subprocess.run([PYTHON, "-m", "poprun_py", *args], capture_output=True, text=True, cwd=copy,
                          env={**env, **without, "MPI4PY_LIBMPI": str(OPENMPI_LIBMPI)}, timeout=SUBPROCESS_TIMEOUT)


@pytest.mark.slow  # starts poprun
@pytest.mark.parametrize("path", [path for path in LAUNCHER_PATHS if path != "gforker"])
def test_a_launcher_that_would_listen_everywhere_is_refused_without_the_library(path: str, tmp_path: Path) -> None:
    """Hydra and Open MPI on one host need the library to stay on loopback: without it poprun
    refuses in one line, before anything starts, instead of opening a port to the network."""
    ran = tmp_path / "ran"
    result = _poprun_without_the_library(tmp_path, *LAUNCHER_PATHS[path][0], "--num-instances", "2",
                                         PYTHON, "-c", f"open({str(ran)!r}, 'w')")
    assert (result.returncode, result.stdout) == (2, ""), result
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("poprun: ") and "would listen on every interface" in result.stderr, result.stderr
    assert str(tmp_path / "install" / "poprun_py") in result.stderr, result.stderr  # the copy's folder, named
    assert not ran.exists()


@pytest.mark.slow  # starts poprun
def test_gforker_needs_no_library(tmp_path: Path) -> None:
    """poprun's own pick for one host listens on nothing, so it runs where the library is missing."""
    result = _poprun_without_the_library(tmp_path, "--num-instances", "2", PYTHON, "-c", "print('ran')")
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0] ran", "[1] ran"], result


def test_the_launchers_library_goes_first_once_and_comes_out_leaving_the_users_entries() -> None:
    path = loopback.library()
    assert path is not None, "poprun_py/shared/_loopback.c was not built with the package"
    assert loopback.preloaded(None, path) == path
    again = loopback.preloaded(loopback.preloaded("/u/a.so:/u/b.so", path), path)  # a restart builds it again
    assert again == f"{path} /u/a.so /u/b.so"
    assert loopback.without_library(again) == "/u/a.so /u/b.so"
    assert loopback.without_library(path) == ""
