"""Restarts that survive a lost host, on the namespace cluster (``tests/cluster.py``): the restart
leaves the host out and spreads the same replicas over the hosts that remain; a host that comes
back is used again once its cooldown has passed."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
import uuid
from pathlib import Path

import pytest

from poprun_py.wire.protocol import DEFAULT_GRACE
from tests.cluster import Cluster
from tests.helpers import PYTHON, ROOT, SHORT_SILENCE, SILENCE_LIMIT, job_marker, run, tagged_json, wait_no_processes
from tests.integration.conftest import FAILURE_BOUND, job_env, job_files, lines_with, mpi_args, start_poprun

pytestmark = [pytest.mark.multihost, pytest.mark.slow, pytest.mark.usefixtures("nothing_left")]

MNIST = str(ROOT / "examples" / "mnist_rts.py")
MNIST_FAIL_ONCE = str(ROOT / "tests" / "scripts" / "mnist_fail_once.py")
DDP = str(ROOT / "tests" / "scripts" / "ddp_train.py")
#: Importing torch takes seconds per process, and the machine may have two cores for them all.
TORCH_TIMEOUT = 120

#: Says where each start put it; the first start waits to be ended, a later one ends at once (or,
#: given a file to wait for, fails once the test has created it).
PROGRAM = ("import os, sys, time\n"
           "e = os.environ\n"
           "print(f\"start {e['POPDIST_RESTART_COUNT']}: {os.uname().nodename} instance {e['RANK']} of "
           "{e['WORLD_SIZE']}, replicas {e['POPDIST_REPLICA_INDEX_OFFSET']}+{e['POPDIST_NUM_LOCAL_REPLICAS']} "
           "of {e['POPDIST_NUM_TOTAL_REPLICAS']}\", flush=True)\n"
           "if e['POPDIST_RESTART_COUNT'] == '0': time.sleep(120)\n"
           "if len(sys.argv) > 2 and e['POPDIST_RESTART_COUNT'] == '1':\n"
           "    while not os.path.exists(sys.argv[2]): time.sleep(0.05)\n"
           "    sys.exit(7)\n")


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_a_lost_host_is_left_out_and_its_replicas_spread_over_the_others(cluster: Cluster, mpi: str,
                                                                         tmp_path: Path) -> None:
    marker = job_marker()
    report = tmp_path / "attempts.json"
    proc = start_poprun(*mpi_args(mpi), "--max-restarts", "2", "--restart-backoff", "0", "--error-file", str(report),
                        "--num-instances", "3", "--num-replicas", "6", "-H", "node0,node1,node2",
                        PYTHON, "-c", PROGRAM, marker, env=job_env(mpi))
    try:
        assert lines_with(proc, "start 0:", 3) == [f"[{i}] start 0: node{i} instance {i} of 3, replicas {2 * i}+2 of 6"
                                               for i in range(3)]
        cluster.kill_host(cluster.host("node2"))  # its sshd, MPI daemon, stubs and programs
        out, err = proc.communicate(timeout=FAILURE_BOUND + 60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert sorted(line for line in out.splitlines() if "start 1:" in line) == [
        f"[{i}] start 1: node{i} instance {i} of 2, replicas {3 * i}+3 of 6" for i in range(2)], f"{out}\n{err}"
    assert re.search(r"^poprun: restarting the job \(1 of 2 restart\(s\)\): host node2 was lost: instance\(s\) 2 "
                     r"there ended without an exit report \(.+\)$", err, re.MULTILINE), err
    assert ("poprun: the restart runs on 2 host(s) without node2 (lost, tried again in 60 s): 2 instance(s) x 3 "
            "local replica(s) = 6 replicas (before: 3 x 2 on 3 host(s))\n") in err
    failed, ended = json.loads(report.read_text())
    assert (failed["restart"], failed["hosts"], failed["instances"], list(failed["lost_hosts"])) == \
        (0, ["node0", "node1", "node2"], 3, ["node2"])
    assert failed["reason"].startswith("host node2 was lost")
    assert ended == {"restart": 1, "hosts": ["node0", "node1"], "instances": 2, "status": 0, "reason": None,
                     "lost_hosts": {}}
    assert wait_no_processes(marker) == []
    # The start that lost node2 was ended on node0 and node1 too: nothing of it stays there.
    assert {name: job_files(cluster, name) for name in ("node0", "node1")} == {"node0": [], "node1": []}, err


def test_a_host_that_comes_back_is_used_again_after_its_cooldown(cluster: Cluster) -> None:
    """node2 is lost at start 0; start 1 runs on node0 and node1 while node2 comes back; once its
    cooldown (1 s) has passed, start 1 fails, and start 2 runs on all three hosts again."""
    marker = job_marker()
    fail = cluster.workdir / f"fail-{marker}"  # not under /tmp, which each host has its own of
    proc = start_poprun("--max-restarts", "2", "--restart-backoff", "0", "--host-cooldown", "1",
                        "--num-instances", "3", "--num-replicas", "6", "-H", "node0,node1,node2",
                        PYTHON, "-c", PROGRAM, marker, str(fail), env=job_env("mpich"))
    try:
        lines_with(proc, "start 0:", 3)
        node2 = cluster.host("node2")
        cluster.kill_host(node2)
        lines_with(proc, "start 1:", 2)
        cluster.restore(node2)
        time.sleep(1.5)  # past the 1 s cooldown, which started before start 1 did: a bound, not a race
        fail.touch()  # start 1 fails now
        out, err = proc.communicate(timeout=FAILURE_BOUND + 60)
    finally:
        proc.kill()
        fail.unlink(missing_ok=True)
    assert proc.returncode == 0, err
    assert sorted(line for line in out.splitlines() if "start 2:" in line) == [
        f"[{i}] start 2: node{i} instance {i} of 3, replicas {2 * i}+2 of 6" for i in range(3)]
    assert ("poprun: the restart runs on 3 host(s) with node2 again: 3 instance(s) x 2 local replica(s) = 6 "
            "replicas (before: 2 x 3 on 2 host(s))\n") in err
    assert wait_no_processes(marker) == []


def test_a_new_host_the_discovery_script_lists_takes_the_place_of_a_lost_one(cluster: Cluster) -> None:
    """The job starts on the hosts the script lists (node0, node1); the scheduler then lists node2
    instead of node1, and node1 is lost: the restart runs on node0 and node2."""
    marker = job_marker()
    listed = cluster.workdir / f"hosts-{marker}"  # not under /tmp, which each host has its own of
    script = cluster.workdir / f"discover-{marker}"
    listed.write_text("node0\nnode1\n")
    script.write_text(f"#!/bin/sh\ncat {listed}\n")
    script.chmod(0o755)
    proc = start_poprun("--max-restarts", "1", "--restart-backoff", "0", "--host-discovery-script", str(script),
                        "--num-instances", "2", "--num-replicas", "4", PYTHON, "-c", PROGRAM, marker,
                        env=job_env("mpich"))
    try:
        assert lines_with(proc, "start 0:", 2) == [f"[{i}] start 0: node{i} instance {i} of 2, replicas {2 * i}+2 of 4"
                                               for i in range(2)]
        listed.write_text("node0\nnode2\n")
        cluster.kill_host(cluster.host("node1"))
        out, err = proc.communicate(timeout=FAILURE_BOUND + 60)
    finally:
        proc.kill()
        listed.unlink(missing_ok=True)
        script.unlink(missing_ok=True)
    assert proc.returncode == 0, err
    assert sorted(line for line in out.splitlines() if "start 1:" in line) == [
        f"[{i}] start 1: node{2 * i} instance {i} of 2, replicas {2 * i}+2 of 4" for i in range(2)], f"{out}\n{err}"
    assert ("poprun: the restart runs on 2 host(s) without node1 (lost), with node2 (discovered): 2 instance(s) x 2 "
            "local replica(s) = 4 replicas (before: 2 x 2 on 2 host(s))\n") in err, err  # node1 is no longer listed
    assert wait_no_processes(marker) == []


def test_too_few_hosts_left_stops_the_job_saying_why(cluster: Cluster, tmp_path: Path) -> None:
    marker = job_marker()
    report = tmp_path / "attempts.json"
    proc = start_poprun("--max-restarts", "2", "--restart-backoff", "0", "--min-hosts", "2", "--error-file",
                        str(report), "--num-instances", "2", "-H", "node0,node1", PYTHON, "-c", PROGRAM, marker,
                        env=job_env("mpich"))
    try:
        lines_with(proc, "start 0:", 2)
        cluster.kill_host(cluster.host("node1"))
        _, err = proc.communicate(timeout=FAILURE_BOUND + 60)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert err.endswith("poprun: not restarting: 1 host(s) left (node0), fewer than --min-hosts 2; left out after "
                        "failing: node1 for 60 s\n"), err
    [attempt] = json.loads(report.read_text())
    assert attempt["lost_hosts"].keys() == {"node1"} and attempt["restart"] == 0
    assert wait_no_processes(marker) == []


def test_mnist_resumes_on_the_hosts_left_with_the_bits_of_a_run_that_never_failed(cluster: Cluster) -> None:
    """6 replicas, 2 per instance on node0-node2; node2 is lost in the middle of the second epoch;
    the restart resumes from the checkpoint after the first on node0 and node1, 3 replicas each,
    and ends with the accuracy and weights of one process that never failed."""
    final = re.compile(r"final: test_accuracy=(\S+) weights_sha256=([0-9a-f]{64})")
    reference = run([PYTHON, MNIST, "--replication-factor", "6", "--epochs", "3"], timeout=120)
    assert reference.returncode == 0, reference.stderr
    checkpoint = cluster.workdir / f"mnist-{uuid.uuid4().hex}.npz"  # where every host sees it
    proc = start_poprun("--max-restarts", "1", "--restart-backoff", "0", "--num-instances", "3", "--num-replicas",
                        "6", "-H", "node0,node1,node2", PYTHON, MNIST_FAIL_ONCE, "--epochs", "3", "--rts",
                        "--checkpoint", str(checkpoint),
                        env=job_env("mpich", MNIST_FAIL_INSTANCE="2", MNIST_FAIL_HOW="pause"))
    try:
        assert lines_with(proc, "pausing mid-epoch", 1) == ["[2] pausing mid-epoch"]
        cluster.kill_host(cluster.host("node2"))
        out, err = proc.communicate(timeout=FAILURE_BOUND + 120)
    finally:
        proc.kill()
        checkpoint.unlink(missing_ok=True)
    assert proc.returncode == 0, err
    assert ("poprun: the restart runs on 2 host(s) without node2 (lost, tried again in 60 s): 2 instance(s) x 3 "
            "local replica(s) = 6 replicas (before: 3 x 2 on 3 host(s))\n") in err
    assert re.search(r"^\[0\] .*resumed from .* after 1 epoch\(s\)$", err, re.MULTILINE), err
    finals = final.findall(out)
    assert len(finals) == 2 and set(finals) == set(final.findall(reference.stdout)), (out, reference.stdout)


@pytest.mark.timeout(3 * TORCH_TIMEOUT)
def test_torch_ddp_resumes_from_its_own_checkpoint_on_fewer_ranks(cluster: Cluster) -> None:
    """An unmodified DDP script, one rank per host on node0-node2, saving a checkpoint every step;
    node2 is lost while the ranks hold at step 2; the restart runs 2 ranks on node0 and node1,
    which resume from the step-2 checkpoint and finish, each saying how many ranks it had. (The
    job's 6 replicas are what a restart spreads: 3 per rank on 2 hosts; a torch script has no use
    for them but the count: 3 replicas would not spread over 2 hosts, and the restart would run
    one rank.)"""
    work = cluster.workdir / f"ddp-{uuid.uuid4().hex}"  # where every host sees it
    work.mkdir()
    proc = start_poprun("--max-restarts", "1", "--restart-backoff", "0", "--num-instances", "3", "--num-replicas", "6",
                        "-H", "node0,node1,node2", PYTHON, DDP, "--steps", "4", "--checkpoint", str(work / "ckpt.pt"),
                        "--hold-at-step", "2", "--marker-dir", str(work), env=job_env("mpich"))
    try:
        deadline = time.monotonic() + TORCH_TIMEOUT
        while not all((work / f"rank{r}").exists() for r in range(3)):  # each rank says it holds at step 2
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)
            time.sleep(0.1)
        cluster.kill_host(cluster.host("node2"))
        out, err = proc.communicate(timeout=FAILURE_BOUND + 2 * TORCH_TIMEOUT)
    finally:
        proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    assert proc.returncode == 0, err
    reports = tagged_json(out)
    assert sorted(reports) == [0, 1], out
    for rank, report in reports.items():
        assert (report["rank"], report["resumed_from"], report["env"]["WORLD_SIZE"]) == (rank, 2, "2")
        assert report["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert len({report["params_sha256"] for report in reports.values()}) == 1


def _hang_sshd(cluster: Cluster, name: str) -> None:
    """The host's sshd stops (SIGSTOP): connections are accepted by the kernel, but no banner comes."""
    sshd = cluster.host(name).sshd
    assert sshd is not None
    for pid in cluster.pids(cluster.host(name)):
        if pid == sshd.pid or _parent(pid) == sshd.pid:
            os.kill(pid, signal.SIGSTOP)


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _kill_daemon(cluster: Cluster, name: str) -> None:
    """MPI's daemon on the host dies (Hydra's proxy, Open MPI's prted); its stubs and programs stay."""
    for line in cluster.processes(cluster.host(name)):
        pid, command = line.split(": ", 1)
        if "hydra_pmi_proxy" in command or "prted" in command:
            os.kill(int(pid), signal.SIGKILL)


#: How each case breaks node1, and whether before the job starts or once every instance runs.
BREAK = {
    "sshd hung": (_hang_sshd, False),
    "sshd refuses": (lambda cluster, name: cluster.stop_sshd(cluster.host(name)), False),
    "partition": (lambda cluster, name: cluster.set_link(cluster.host(name), up=False), True),
    "daemon dies": (_kill_daemon, True),
    "host dies": (lambda cluster, name: cluster.kill_host(cluster.host(name)), True),
}


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
@pytest.mark.parametrize("case", list(BREAK))
def test_the_host_that_failed_is_named_and_left_out(cluster: Cluster, mpi: str, case: str, tmp_path: Path) -> None:
    """Whatever breaks node1, before the job or in it, a failure that names a host names node1,
    --error-file lists it lost, and the restart runs on node0 and node2. (Hydra sometimes ends
    before ssh's line about a refusing host reaches its stderr: that start names no host, and the
    next one, on the same hosts, does; hence two restarts.)"""
    marker = job_marker()
    report = tmp_path / "attempts.json"
    brk, mid_job = BREAK[case]
    if not mid_job:
        brk(cluster, "node1")
    proc = start_poprun(*mpi_args(mpi), "--max-restarts", "2", "--restart-backoff", "0", "--error-file", str(report),
                        "--num-instances", "3", "--num-replicas", "6", "-H", "node0,node1,node2",
                        PYTHON, "-c", PROGRAM, marker, env=job_env(mpi, **SHORT_SILENCE))
    try:
        if mid_job:
            lines_with(proc, "start 0:", 3)
            brk(cluster, "node1")
        out, err = proc.communicate(timeout=3 * FAILURE_BOUND + 60)
    finally:
        proc.kill()
        if case == "sshd hung":  # its stopped processes go; the fixture starts a new sshd
            cluster.kill_host(cluster.host("node1"))
    assert proc.returncode == 0, err
    *failed, ended = json.loads(report.read_text())
    assert [list(record["lost_hosts"]) for record in failed][-1:] == [["node1"]], (failed, err)
    assert all(list(record["lost_hosts"]) in ([], ["node1"]) for record in failed), (failed, err)
    naming = [line for line in err.splitlines() if line.startswith("poprun: restarting the job") and "node" in line]
    assert naming and all("node1" in line and "node0" not in line and "node2" not in line for line in naming), err
    assert ("poprun: the restart runs on 2 host(s) without node1 (lost, tried again in 60 s): 2 instance(s) x 3 "
            "local replica(s) = 6 replicas (before: 3 x 2 on 3 host(s))\n") in err
    last = ended["restart"]
    assert (ended["hosts"], ended["status"]) == (["node0", "node2"], 0)
    assert sorted(line for line in out.splitlines() if f"start {last}:" in line) == [
        f"[{i}] start {last}: node{2 * i} instance {i} of 2, replicas {3 * i}+3 of 6" for i in range(2)]
    # Cut off, node1's stubs stop their programs by themselves once their frames have gone
    # unacknowledged for the silence limit; the restart elsewhere may well end before that.
    assert wait_no_processes(marker, within=SILENCE_LIMIT + DEFAULT_GRACE + 5 if case == "partition" else 5) == []
