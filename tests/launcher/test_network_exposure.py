"""A job on one host opens nothing beyond loopback: every socket its processes listen on (TCP) or
have bound (UDP), read from /proc while the job runs, is on 127.0.0.0/8 or ::1."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
from pathlib import Path

import pytest

from poprun_py import leftovers, loopback
from tests.helpers import OPENMPI_LIBMPI, OPENMPI_MPIEXEC, POPRUN, PYTHON, ROOT, SUBPROCESS_TIMEOUT

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


def _job_sockets(mpi: str, tmp_path: Path) -> dict[str, list[str]]:
    """What each process of a running two-instance one-host job listens on (or has bound), by
    ``PID command``; the job ran to status 0."""
    go = tmp_path / "go"
    args, env = (["--mpi", str(OPENMPI_MPIEXEC)], {"MPI4PY_LIBMPI": str(OPENMPI_LIBMPI)}) if mpi == "openmpi" \
        else ([], {})
    proc = subprocess.Popen([*POPRUN, *args, "--num-instances", "2", PYTHON, "-c", PROGRAM, str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, **env})
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
    return opened


#: The launchers of Open MPI (prterun is what its mpiexec execs, prted its daemon).
OPENMPI_LAUNCHERS = ("prterun", "prted", "mpiexec", "mpirun")


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_a_one_host_jobs_instances_listen_on_loopback_only(mpi: str, tmp_path: Path) -> None:
    opened = _job_sockets(mpi, tmp_path)
    instances = {who: entries for who, entries in opened.items() if who.split()[1] not in OPENMPI_LAUNCHERS}
    assert _beyond_loopback([entry for entries in instances.values() for entry in entries]) == [], opened


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_a_one_host_job_listens_on_loopback_only(mpi: str, tmp_path: Path) -> None:
    opened = _job_sockets(mpi, tmp_path)
    assert _beyond_loopback([entry for entries in opened.values() for entry in entries]) == [], opened


@pytest.mark.parametrize("users", [None, "libm.so.6"])
def test_the_launchers_library_stays_out_of_the_programs_environment(users: str | None) -> None:
    """poprun preloads its library into Open MPI's launcher on one host (that is what keeps it on
    loopback, above); the program gets LD_PRELOAD as its user set it, or not at all."""
    env = {**os.environ, "MPI4PY_LIBMPI": str(OPENMPI_LIBMPI)}
    env.pop("LD_PRELOAD", None)
    if users:
        env["LD_PRELOAD"] = users
    code = "import json, os; print(json.dumps(os.environ.get('LD_PRELOAD')))"
    result = subprocess.run([*POPRUN, "--mpi", str(OPENMPI_MPIEXEC), "--num-instances", "2", PYTHON, "-c", code],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[{i}] {json.dumps(users)}" for i in range(2)], result.stdout


def test_the_launchers_library_goes_first_once_and_comes_out_leaving_the_users_entries() -> None:
    path = loopback.library()
    assert path is not None, "poprun_py/_loopback.c was not built with the package"
    assert loopback.preloaded(None, path) == path
    again = loopback.preloaded(loopback.preloaded("/u/a.so:/u/b.so", path), path)  # a restart builds it again
    assert again == f"{path} /u/a.so /u/b.so"
    assert loopback.without_library(again) == "/u/a.so /u/b.so"
    assert loopback.without_library(path) == ""
