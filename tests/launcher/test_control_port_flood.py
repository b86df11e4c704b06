"""Strangers on the control port: any local process can connect to a one-host job's (any host on
the network to a multi-host job's). A real job under a real flood of connections that send bytes no
stub sends: poprun says so in a few lines, not one per connection, and the job's own instances
still call in, their output arrives, and the job succeeds."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from poprun_py.supervision.strays import REPORT_SECONDS
from tests.helpers import MPICH_MPIEXEC, OMP_SET, POPRUN, ROOT, SUBPROCESS_TIMEOUT, wait_until

pytestmark = pytest.mark.slow

#: The flood of the report this answers: 364 connections, 64 bad bytes each. Flooded at least this
#: many, and on until the job is over.
AT_LEAST = 364
AT_MOST = 20000

#: An mpiexec that tells the test where poprun listens and waits for its word before it starts the
#: job (Hydra, MPICH's mpiexec, whose command line carries POPRUN_CONTROL), so the flood is on
#: before any instance calls in.
WRAPPER = """\
import os, sys, time
args = sys.argv[1:]
if "POPRUN_CONTROL" in args:
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "address.tmp"), "w") as f:
        f.write(args[args.index("POPRUN_CONTROL") + 1])
    os.rename(os.path.join(here, "address.tmp"), os.path.join(here, "address"))
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(here, "go")) and time.monotonic() < deadline:
        time.sleep(0.005)
os.execv({real!r}, [{real!r}, *args])
"""


def _flood(address: str, job: subprocess.Popen[bytes], sent: list[int], started: threading.Event) -> None:
    """Connections that each take poprun's nonce, send 64 bytes no stub sends and close, until the
    job is over; ``started`` once AT_LEAST have."""
    host, port = address.rsplit(":", 1)
    while job.poll() is None and sent[0] < AT_MOST:
        garbage = bytes((sent[0] * 37 + k) % 256 for k in range(64))
        try:
            with socket.create_connection((host, int(port)), timeout=5) as stray:
                stray.recv(16, socket.MSG_WAITALL)
                stray.sendall(garbage)
        except OSError:
            continue  # the backlog is full, or poprun has just closed the port
        sent[0] += 1
        if sent[0] == AT_LEAST:
            started.set()
    started.set()


def test_a_flood_of_strangers_is_a_few_lines_and_the_job_still_runs(tmp_path: Path) -> None:
    wrapper = tmp_path / "mpiexec"
    wrapper.write_text(f"#!{sys.executable}\n" + WRAPPER.format(real=str(MPICH_MPIEXEC)))
    wrapper.chmod(0o755)
    program = "import os; print('hello from', os.environ['RANK'])"
    job = subprocess.Popen([*POPRUN, "--mpi", str(wrapper), "--num-instances", "4", sys.executable, "-c", program],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env={**os.environ, **OMP_SET})
    sent = [0]
    started = threading.Event()
    try:
        wait_until(lambda: (tmp_path / "address").exists() or job.poll() is not None, "poprun to start mpiexec")
        address = (tmp_path / "address").read_text()
        flood = threading.Thread(target=_flood, args=(address, job, sent, started), daemon=True)
        flood.start()
        assert started.wait(SUBPROCESS_TIMEOUT)  # AT_LEAST strangers came before mpiexec starts
        (tmp_path / "go").touch()
        stdout, stderr = job.communicate(timeout=SUBPROCESS_TIMEOUT)
        flood.join(SUBPROCESS_TIMEOUT)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    said = stderr.decode().splitlines()
    assert job.returncode == 0, stderr.decode()
    assert sorted(stdout.decode().splitlines()) == [f"[{i}] hello from {i}" for i in range(4)]
    # The first refused connection in full, then a count at most every REPORT_SECONDS and at the end.
    assert said and " POPRUN [E] unexpected connection on the control port from 127.0.0.1:" in said[0], said[:5]
    counts = said[1:]
    assert all(" POPRUN [E] refused " in line and " more connection(s) on the control port in the last " in line
               for line in counts), said[:5]
    assert len(counts) <= 1 + 60 / REPORT_SECONDS
    refused = 1 + sum(int(line.split(" refused ", 1)[1].split()[0]) for line in counts)
    assert AT_LEAST <= refused <= sent[0], (refused, sent, said)
