"""``poprun -H node0,node1 ...`` from the root namespace onto real hosts: network namespaces, each
with its own address, hostname and sshd (``tests/cluster.py``), MPICH and Open MPI.

MPI is kept on the network (``UCX_TLS=self,tcp``; each host has its own ``/tmp`` and ``/dev/shm``),
and the interface counters show that the bytes really crossed it. After every test no process of the
job is left on any host, nor here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster import NETWORK_ENV, Cluster
from tests.helpers import (
    BIN,
    INSTANCE_COMMAND,
    OMP_SET,
    POPRUN,
    PYTHON,
    ROOT,
    SHORT_SILENCE,
    SILENCE_LIMIT,
    SUBPROCESS_TIMEOUT,
    job_marker,
    poprun,
    run,
    tagged_json,
    wait_no_processes,
)
from tests.integration.cascade import CASCADE, check_cascade
from tests.integration.conftest import (
    FAILURE_BOUND,
    JOB_FILE_PREFIXES,
    job_env,
    mpi_args,
    start_poprun,
    wait_started,
)
from tests.launcher.job_shell import TICKER, Shell
from tests.launcher.rendering import TWO_STREAMS, flat, instances_text, without_poprun
from tests.launcher.test_job_control import COUNT, stop_and_continue
from tests.launcher.test_program_arguments import AWKWARD_WORDS, MEGABYTE, MPIEXEC_WORDS, SHOW_ARGV, received_directly

pytestmark = [pytest.mark.multihost, pytest.mark.slow, pytest.mark.usefixtures("nothing_left")]

SCRIPTS = ROOT / "tests" / "scripts"
WHERE = str(SCRIPTS / "where_and_what.py")
BEHAVE = str(SCRIPTS / "behave.py")
ENGINE_TRAIN = str(SCRIPTS / "engine_train.py")
MNIST = str(ROOT / "examples" / "mnist_rts.py")


def tx_bytes(cluster: Cluster, network: int | None = None) -> dict[str, int]:
    """Bytes each host has sent on ``network`` (all networks: MPI spreads over every one it may use)."""
    networks = range(len(cluster.subnets)) if network is None else [network]
    return {h.name: sum(cluster.counters(h, n)[1] for n in networks) for h in cluster.hosts}


# ------------------------------------------------------------------ placement and environment
@pytest.mark.parametrize("mpi,num_hosts,per_host", [("mpich", 2, 1), ("mpich", 2, 3), ("mpich", 3, 2),
                                                     ("openmpi", 2, 2), ("openmpi", 3, 1)])
def test_instances_land_where_the_plan_says_with_their_environment(cluster: Cluster, mpi: str, num_hosts: int,
                                                                   per_host: int) -> None:
    hosts = cluster.names[:num_hosts]
    instances = num_hosts * per_host
    extra = {"POPDIST_COLLECTIVE_TIMEOUT": "77", "PYTHONPATH": str(ROOT / "tests"),
             "LD_LIBRARY_PATH": "/opt/poprun-test/lib", "VIRTUAL_ENV": str(BIN.parent)}
    result = poprun(*mpi_args(mpi), "--num-instances", str(instances), "--num-replicas", str(2 * instances),
                    "-H", ",".join(hosts), PYTHON, WHERE, env=job_env(mpi, **extra))
    assert result.returncode == 0, result.stderr
    found = tagged_json(result.stdout)
    assert sorted(found) == list(range(instances))
    for i, report in found.items():
        env = report["env"]
        assert report["host"] == hosts[i // per_host], f"instance {i}"
        assert env["LOCAL_RANK"] == env["POPDIST_LOCAL_INSTANCE_INDEX"] == str(i % per_host)
        assert env["LOCAL_WORLD_SIZE"] == str(per_host) and env["WORLD_SIZE"] == str(instances)
        assert env["POPDIST_INSTANCE_INDEX"] == env["RANK"] == str(i)
        assert env["POPDIST_REPLICA_INDEX_OFFSET"] == str(2 * i)
        assert env["POPDIST_NUM_LOCAL_REPLICAS"] == "2"
        assert env["POPDIST_COLLECTIVE_TIMEOUT"] == "77"  # a POPDIST_* variable of the caller's
        # Instances call back on the address of the route towards the hosts, never on loopback.
        assert env["POPRUN_CONTROL"].startswith(cluster.bridge_addresses[0] + ":")
        for name in ("PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV"):
            assert report["forwarded"][name] == extra[name], name
        assert report["forwarded"]["PATH"] == os.environ["PATH"]


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_each_host_has_one_supervisor_and_one_connection_to_poprun(cluster: Cluster, mpi: str) -> None:
    """A cost per host: each instance's program is started by its stub (this install's, or what
    POPRUN_STUB names), and each host's one supervisor holds the host's one connection to poprun."""
    parent = "import os; print(open(f'/proc/{os.getppid()}/cmdline', 'rb').read().split(bytes(1))[0].decode())"
    result = poprun(*mpi_args(mpi), "-vv", "--num-instances", "6", "-H", "node0,node1", PYTHON, "-c", parent,
                    env=job_env(mpi))
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[{i}] {INSTANCE_COMMAND[0]}" for i in range(6)], result.stdout
    assert sorted(re.findall(r" the supervisor of host (\S+) connected \(pid \d+\)$", result.stderr, re.MULTILINE)) \
        == ["node0", "node1"], result.stderr
    called_in = re.findall(r" instance (\d) connected from (node\d) ", result.stderr)
    assert sorted(called_in) == [(str(i), f"node{i // 3}") for i in range(6)], result.stderr


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_a_remote_program_receives_its_arguments_byte_for_byte(cluster: Cluster, mpi: str) -> None:
    """Words of mpiexec's syntax, empty strings, newlines, quotes, bytes that are not UTF-8 and a
    megabyte of them reach the program on each remote host as they reach it run directly: they
    travel in the stub's sealed connection to poprun, not through mpiexec and ssh."""
    args = [*MPIEXEC_WORDS, *AWKWARD_WORDS, *MEGABYTE]
    expected = received_directly(args)
    result = subprocess.run([*POPRUN, *mpi_args(mpi), "--num-instances", "2", "-H", "node0,node1", PYTHON, SHOW_ARGV,
                             *args], capture_output=True, timeout=FAILURE_BOUND + 30, cwd=ROOT,
                            env={**os.environ, **job_env(mpi)})
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-2000:]
    assert sorted(result.stdout.decode().splitlines()) == [f"[0] {expected}", f"[1] {expected}"]


def test_slurm_allocation_gives_the_hosts(cluster: Cluster) -> None:
    result = poprun("-v", "--num-instances", "2", PYTHON, WHERE,
                    env={**NETWORK_ENV, "SLURM_JOB_NODELIST": f"{cluster.name_prefix}[0-1]"})
    assert result.returncode == 0, result.stderr
    assert f"using the 2 host(s) Slurm gives in SLURM_JOB_NODELIST={cluster.name_prefix}[0-1]" \
        in result.stderr
    assert {i: r["host"] for i, r in tagged_json(result.stdout).items()} == {0: "node0", 1: "node1"}
    # sbatch -N2 --ntasks-per-node=2: 4 instances, 2 on each host, as Slurm's tasks allow.
    tasks = {**NETWORK_ENV, "SLURM_JOB_NODELIST": f"{cluster.name_prefix}[0-1]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    result = poprun("--num-instances", "4", PYTHON, WHERE, env=tasks)
    assert result.returncode == 0, result.stderr
    assert {i: r["host"] for i, r in tagged_json(result.stdout).items()} == {0: "node0", 1: "node0", 2: "node1",
                                                                            3: "node1"}


#: Each file-based scheduler's host file, in its real format, for node0 and node1 with 2 slots each.
SCHEDULER_FILES = {
    "PBS_NODEFILE": "node0\nnode1\nnode0\nnode1\n",  # one line per slot (PBS lists them round-robin too)
    "PE_HOSTFILE": "node0 2 all.q@node0 UNDEFINED\nnode1 2 all.q@node1 UNDEFINED\n",  # Grid Engine
    "OMPI_MCA_orte_default_hostfile": "node0 slots=2\nnode1 slots=2\n",  # the MPI Operator, Open MPI jobs
    "HYDRA_HOST_FILE": "node0:2\nnode1:2\n",  # the MPI Operator, MPICH jobs
}


@pytest.mark.parametrize("variable,mpi", [("PBS_NODEFILE", "mpich"), ("PE_HOSTFILE", "mpich"),
                                          ("OMPI_MCA_orte_default_hostfile", "openmpi"), ("HYDRA_HOST_FILE", "mpich")])
def test_a_schedulers_host_file_gives_the_hosts_and_their_slots(cluster: Cluster, tmp_path: Path, variable: str,
                                                                mpi: str) -> None:
    """4 instances on the 2 hosts the file names, 2 on each as its slots allow; 6 do not fit."""
    hosts = tmp_path / "hosts"
    hosts.write_text(SCHEDULER_FILES[variable])
    env = job_env(mpi, **{variable: str(hosts)})
    result = poprun(*mpi_args(mpi), "-v", "--num-instances", "4", PYTHON, WHERE, env=env)
    assert result.returncode == 0, result.stderr
    said = f"in {variable}={hosts} (slots: node0:2, node1:2)"
    assert "no -H/--host-file: using the 2 host(s) " in result.stderr and said in result.stderr, result.stderr
    assert {i: r["host"] for i, r in tagged_json(result.stdout).items()} == {0: "node0", 1: "node0", 2: "node1",
                                                                              3: "node1"}
    refused = poprun(*mpi_args(mpi), "--num-instances", "6", PYTHON, WHERE, env=env)
    fewer = "node0:2, node1:2: fewer slots than the 3 instances per host that 6 instances on 2 hosts need\n"
    assert refused.returncode == 2 and refused.stderr.endswith(fewer), refused.stderr


# ------------------------------------------------------------------ torchrun's contract across hosts
TORCHRUN_ENV = str(SCRIPTS / "torchrun_env.py")
DDP = str(SCRIPTS / "ddp_train.py")
#: torch's import takes seconds per process.
TORCH_TIMEOUT = 120


@pytest.mark.parametrize("mpi,user_set", [("mpich", False), ("openmpi", False), ("openmpi", True)])
def test_torchruns_variables_reach_every_host(cluster: Cluster, mpi: str, user_set: bool) -> None:
    """Host h is torchrun's group h of 2; MASTER_ADDR is instance 0's host as the others reach it,
    MASTER_PORT torchrun's 29500 (or --master-port); each host's instances divide its cores, unless
    the user set OMP_NUM_THREADS, which then reaches every host as set (Open MPI forwards nothing
    unless told); each instance has an error file it can write on its own host."""
    extra = {"OMP_NUM_THREADS": "5"} if user_set else {}
    ports = ["--master-port", "29601"] if user_set else []
    result = poprun(*mpi_args(mpi), *ports, "--num-instances", "4", "-H", "node0,node1", PYTHON, TORCHRUN_ENV,
                    env=job_env(mpi, **extra))
    assert result.returncode == 0, result.stderr
    found = tagged_json(result.stdout)
    assert sorted(found) == [0, 1, 2, 3]
    run_id = found[0]["env"]["TORCHELASTIC_RUN_ID"]
    for i, report in found.items():
        env = report["env"]
        assert report["host"] == f"node{i // 2}" and report["error_file_writable"], i
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == (str(i // 2), "2")
        assert (env["RANK"], env["ROLE_RANK"], env["LOCAL_RANK"]) == (str(i), str(i), str(i % 2))
        assert (env["WORLD_SIZE"], env["ROLE_WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("4", "4", "2")
        assert (env["ROLE_NAME"], env["TORCHELASTIC_USE_AGENT_STORE"]) == ("default", "False")
        assert env["MASTER_ADDR"] == cluster.host("node0").address
        assert env["MASTER_PORT"] == ("29601" if user_set else "29500")
        assert env["TORCHELASTIC_RUN_ID"] == run_id
        assert env["TORCHELASTIC_ERROR_FILE"] == f"/tmp/poprun-{run_id}/error-{i}.json"
        assert env["OMP_NUM_THREADS"] == ("5" if user_set else str(max(1, report["cores"] // 2)))
    assert ("OMP_NUM_THREADS is not set" in result.stderr) != user_set


def test_torchruns_master_on_this_machine_with_a_remote_host(cluster: Cluster) -> None:
    """Instance 0 here: MASTER_ADDR is poprun's own address on --host-subnet's network (the one the
    remote host calls back on), MASTER_PORT a port poprun found free on it."""
    result = poprun("--host-subnet", str(cluster.subnets[0]), "--num-instances", "2", "-H", "localhost,node1",
                    PYTHON, TORCHRUN_ENV, env=job_env("mpich"))
    assert result.returncode == 0, result.stderr
    found = tagged_json(result.stdout)
    assert {r["env"]["MASTER_ADDR"] for r in found.values()} == {cluster.bridge_addresses[0]}
    ports = {r["env"]["MASTER_PORT"] for r in found.values()}
    assert len(ports) == 1 and ports != {"29500"}
    assert [found[i]["env"]["GROUP_RANK"] for i in (0, 1)] == ["0", "1"]


def _ddp_hashes(stdout: str) -> set[str]:
    reports = tagged_json(stdout)
    assert sorted(reports) == [0, 1]
    return {report["params_sha256"] for report in reports.values()}


@pytest.mark.timeout(3 * TORCH_TIMEOUT)
@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_torch_ddp_across_two_hosts_is_one_host(cluster: Cluster, mpi: str) -> None:
    """An unmodified DDP script (gloo, env://) on node0 and node1 ends with the parameters of the
    same job on one host, every rank agreeing; torch's traffic crosses the network."""
    reference = poprun("--num-instances", "2", PYTHON, DDP, "--steps", "3", env=OMP_SET, timeout=TORCH_TIMEOUT)
    assert reference.returncode == 0, reference.stderr
    before = tx_bytes(cluster)
    result = poprun(*mpi_args(mpi), "--num-instances", "2", "-H", "node0,node1", PYTHON, DDP, "--steps", "3",
                    env=job_env(mpi), timeout=TORCH_TIMEOUT)
    assert result.returncode == 0, result.stderr
    hashes = _ddp_hashes(result.stdout)
    assert len(hashes) == 1 and hashes == _ddp_hashes(reference.stdout)
    reports = tagged_json(result.stdout)
    assert {r["env"]["MASTER_ADDR"] for r in reports.values()} == {cluster.host("node0").address}
    assert min(tx_bytes(cluster)[h] - before[h] for h in ("node0", "node1")) > 0


@pytest.mark.timeout(TORCH_TIMEOUT + 30)
def test_a_recorded_failure_on_a_remote_host_reaches_the_summary(cluster: Cluster, tmp_path: Path) -> None:
    """poprun cannot read node1's disk: node1's stub sends the record of the failed program back."""
    error_file = tmp_path / "failure.json"
    result = poprun("--error-file", str(error_file), "--num-instances", "2", "-H", "node0,node1", PYTHON, DDP,
                    "--steps", "3", "--fail-at-step", "1", env=job_env("mpich"), timeout=TORCH_TIMEOUT)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    at = lines.index("poprun: root cause (instance 1's error file): RuntimeError: step 1 failed on purpose")
    assert lines[at - 1] == "poprun: instance 1 on node1 failed: exit status 1"
    assert any(line.endswith(", in fail_on_purpose") for line in lines[at:]), result.stderr
    report = json.loads(error_file.read_text())[-1]
    assert (report["host"], report["root_cause"]["message"]) == ("node1", "RuntimeError: step 1 failed on purpose")
    assert ", in fail_on_purpose\n" in report["root_cause"]["traceback"]


@pytest.mark.timeout(TORCH_TIMEOUT + 30)
@pytest.mark.parametrize("failed,linger", [(1, 3.0), (2, 0.5)])
def test_the_rank_that_raised_on_either_host_is_the_root_cause(cluster: Cluster, tmp_path: Path, failed: int,
                                                               linger: float) -> None:
    """tests/scripts/cascade.py on node0 and node1: the rank that raised destroys its process group,
    the others on both hosts fail on the closed connections and exit first, while it lingers for
    ``linger`` seconds; its stub's times, made poprun's with its clock's offset, name it."""
    error_file = tmp_path / "failure.json"
    result = poprun("--error-file", str(error_file), "--num-instances", "4", "-H", "node0,node1", PYTHON, CASCADE,
                    "--fail-rank", str(failed), "--linger", str(linger), env=job_env("mpich", **OMP_SET),
                    timeout=TORCH_TIMEOUT)
    check_cascade(result, error_file, 4, failed, ["node0", "node0", "node1", "node1"])


HOROVOD_MIXED = str(SCRIPTS / "horovod_mixed.py")


@pytest.mark.timeout(3 * TORCH_TIMEOUT)
def test_an_unmodified_horovod_job_across_hosts_ends_right(cluster: Cluster) -> None:
    """tests/scripts/horovod_mixed.py under poprun --horovod on node0 and node1: ranks that submit
    in different orders and run out of data at different times end with one set of parameters,
    over the network; a rank on node1 that raises is the job's one error."""
    before = tx_bytes(cluster)
    result = poprun("--horovod", "--num-instances", "4", "-H", "node0,node1", PYTHON, HOROVOD_MIXED,
                    env=job_env("mpich", **OMP_SET), timeout=TORCH_TIMEOUT)
    assert result.returncode == 0, result.stderr
    reports = tagged_json(result.stdout)
    assert sorted(reports) == [0, 1, 2, 3] and len({r["digest"] for r in reports.values()}) == 1
    assert {r["last_to_join"] for r in reports.values()} == {3}
    assert min(tx_bytes(cluster)[h] - before[h] for h in ("node0", "node1")) > 0
    failed = poprun("--horovod", "--num-instances", "2", "-H", "node0,node1", PYTHON, HOROVOD_MIXED,
                    "--raise-at", "1", env=job_env("mpich", **OMP_SET), timeout=TORCH_TIMEOUT)
    assert failed.returncode == 1
    lines = failed.stderr.splitlines()
    assert [line for line in lines if re.match(r"poprun: instance \d+ on \S+ failed", line)] == [
        "poprun: instance 1 on node1 failed: exit status 1"], failed.stderr
    assert "ValueError: rank 1 cannot read batch 1" in failed.stderr


# ------------------------------------------------------------------ collectives across hosts
@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_each_instance_keeps_the_order_of_its_two_streams_across_hosts(cluster: Cluster, mpi: str,
                                                                      tmp_path: Path) -> None:
    """Issue 40: poprun's stdout and stderr one file (``2>&1``), two instances on each of two hosts;
    each shows its stdout and stderr in the order it wrote them, as ``2>&1`` without poprun."""
    rounds = 100
    alone, _ = without_poprun(tmp_path, rounds)
    path = tmp_path / "out.txt"
    with open(path, "wb") as both:
        result = subprocess.run([*POPRUN, *mpi_args(mpi), "--num-instances", "4", "-H", ",".join(cluster.names[:2]),
                                 PYTHON, TWO_STREAMS, str(rounds)], stdin=subprocess.DEVNULL, stdout=both,
                                stderr=both, env={**os.environ, **job_env(mpi, **OMP_SET)}, cwd=ROOT,
                                timeout=SUBPROCESS_TIMEOUT)
    shown = path.read_bytes()
    assert result.returncode == 0, shown
    assert instances_text(shown) == {i: flat(alone) for i in range(4)}


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_host_collectives_cross_the_network(cluster: Cluster, mpi: str) -> None:
    before = tx_bytes(cluster)
    result = poprun(*mpi_args(mpi), "--num-instances", "4", "-H", "node0,node1", PYTHON, WHERE, "--collectives",
                    env=job_env(mpi))
    assert result.returncode == 0, result.stderr
    assert all(r["collectives"] == "ok" for r in tagged_json(result.stdout).values())
    after = tx_bytes(cluster)
    # Each host needs the other's share of every element of the 4 MiB result: at least that crosses.
    for name in ("node0", "node1"):
        assert after[name] - before[name] > 4 << 20, f"{name} sent {after[name] - before[name]} bytes"


def _hashes(stdout: str) -> set[str]:
    found = set(re.findall(r"weights-sha256 ([0-9a-f]{64}) ", stdout))
    assert found, stdout
    return found


@pytest.mark.parametrize("mpi,instances", [("mpich", 2), ("mpich", 4), ("openmpi", 2)])
def test_engine_training_across_hosts_is_bitwise_one_process(cluster: Cluster, mpi: str, instances: int) -> None:
    reference = run([PYTHON, ENGINE_TRAIN, "--replicas", "4", "--steps", "6"])
    assert reference.returncode == 0, reference.stderr
    result = poprun(*mpi_args(mpi), "--num-instances", str(instances), "--num-replicas", "4", "-H", "node0,node1",
                    PYTHON, ENGINE_TRAIN, "--steps", "6", env=job_env(mpi), timeout=120)
    assert result.returncode == 0, result.stderr
    assert _hashes(result.stdout) == _hashes(reference.stdout)


def test_mnist_with_rts_on_two_hosts_is_bitwise_one_host(cluster: Cluster) -> None:
    final = re.compile(r"final: test_accuracy=(\S+) weights_sha256=([0-9a-f]{64})")
    reference = run([PYTHON, MNIST, "--replication-factor", "4", "--epochs", "2"], timeout=120)
    assert reference.returncode == 0, reference.stderr
    before = tx_bytes(cluster)
    result = poprun("--num-instances", "2", "--num-replicas", "4", "-H", "node0,node1", PYTHON, MNIST,
                    "--epochs", "2", "--rts", env=job_env("mpich"), timeout=120)
    assert result.returncode == 0, result.stderr
    finals = final.findall(result.stdout)
    assert len(finals) == 2 and set(finals) == set(final.findall(reference.stdout))
    assert min(tx_bytes(cluster)[h] - before[h] for h in ("node0", "node1")) > 1 << 20


# ------------------------------------------------------------------ --host-subnet
@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_host_subnet_keeps_control_and_mpi_on_that_network(cluster: Cluster, mpi: str) -> None:
    subnet = str(cluster.subnets[1])
    first, second = tx_bytes(cluster, 0), tx_bytes(cluster, 1)
    result = poprun(*mpi_args(mpi), "--host-subnet", subnet, "--num-instances", "2", "-H", "node0,node1",
                    PYTHON, WHERE, "--collectives", env=job_env(mpi))
    assert result.returncode == 0, result.stderr
    found = tagged_json(result.stdout)
    assert all(r["collectives"] == "ok" for r in found.values())
    assert all(r["env"]["POPRUN_CONTROL"].startswith(cluster.bridge_addresses[1] + ":") for r in found.values())
    assert all(r["forwarded"]["UCX_NET_DEVICES"] == "eth1" for r in found.values())  # each host's own name
    for name in ("node0", "node1"):
        on_subnet = tx_bytes(cluster, 1)[name] - second[name]
        elsewhere = tx_bytes(cluster, 0)[name] - first[name]
        assert on_subnet > 4 << 20, f"{name}: {on_subnet} bytes on {subnet}"
        assert elsewhere < 256 << 10, f"{name}: {elsewhere} bytes on the other network (ssh only)"


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_a_job_on_this_machine_and_a_remote_host(cluster: Cluster, mpi: str) -> None:
    # This machine has interfaces the hosts cannot reach (MPICH's UCX would try them):
    # --host-subnet names the network every instance shares.
    result = poprun(*mpi_args(mpi), "--host-subnet", str(cluster.subnets[0]), "--num-instances", "4",
                    "-H", "localhost,node1", PYTHON, WHERE, "--collectives", env=job_env(mpi))
    assert result.returncode == 0, result.stderr
    found = tagged_json(result.stdout)
    assert [found[i]["host"] for i in range(4)] == [os.uname().nodename] * 2 + ["node1"] * 2
    assert all(r["collectives"] == "ok" for r in found.values())


def test_host_subnet_that_no_interface_is_in_is_one_line(cluster: Cluster) -> None:
    result = poprun("--host-subnet", "10.254.253.0/24", "-H", "node0,node1", "--num-instances", "2", "/bin/true")
    assert result.returncode == 2
    assert result.stderr.startswith("poprun: error: --host-subnet 10.254.253.0/24: no local interface has an "
                                    "address in it; local addresses: ")
    assert result.stderr.count("\n") == 1


# ------------------------------------------------------------------ large jobs
# ------------------------------------------------------------------ hosts that fail
@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
@pytest.mark.parametrize("failure,said", [("sshd stopped", "Connection refused"),
                                          ("link down", "Connection timed out")])  # only ConnectTimeout ends it
def test_host_that_cannot_be_reached(cluster: Cluster, mpi: str, failure: str, said: str) -> None:
    marker = job_marker()
    node1 = cluster.host("node1")
    if failure == "sshd stopped":
        cluster.stop_sshd(node1)
    else:
        cluster.set_link(node1, up=False)
    start = time.monotonic()
    result = poprun(*mpi_args(mpi), "--num-instances", "2", "-H", "node0,node1", PYTHON, BEHAVE, marker,
                    env=job_env(mpi, **SHORT_SILENCE), timeout=FAILURE_BOUND + 30)  # ssh waits half of it
    assert result.returncode == 255 and time.monotonic() - start < FAILURE_BOUND
    assert re.fullmatch(r"poprun: error: instance\(s\) [0-9, -]+ could not be started: host node1: "
                        rf"ssh: connect to host node1 port 22: {said}\n", result.stderr), result.stderr
    assert wait_no_processes(marker) == []


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_host_that_dies_mid_job(cluster: Cluster, mpi: str) -> None:
    marker = job_marker()
    proc = start_poprun(*mpi_args(mpi), "--num-instances", "4", "-H", "node0,node1", PYTHON, BEHAVE, marker,
                  env=job_env(mpi))
    try:
        wait_started(proc, 4)
        start = time.monotonic()
        cluster.kill_host(cluster.host("node1"))  # its sshd, MPI daemon, stubs and programs
        _, stderr = proc.communicate(timeout=FAILURE_BOUND + 30)
        took = time.monotonic() - start
    finally:
        proc.kill()
    assert proc.returncode != 0 and took < FAILURE_BOUND
    assert re.search(r"^poprun: host node1 was lost: instance\(s\) 2-3 there ended without an exit report \(.+\)$",
                     stderr, re.MULTILINE), stderr
    assert wait_no_processes(marker) == []


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_host_cut_off_mid_job(cluster: Cluster, mpi: str) -> None:
    """No FIN, no RST: the host's link goes down. poprun hears nothing from its instances and gives
    up on them; their stubs, whose heartbeats go unacknowledged, stop their programs by themselves,
    and the host's MPI daemon ends too (Open MPI's on the keep-alives poprun gives it), so nothing
    of the job stays there, while still cut off."""
    marker = job_marker()
    node1 = cluster.host("node1")
    proc = start_poprun(*mpi_args(mpi), "--num-instances", "4", "-H", "node0,node1", PYTHON, BEHAVE, marker,
                        env=job_env(mpi, **SHORT_SILENCE))
    try:
        wait_started(proc, 4)
        start = time.monotonic()
        cluster.set_link(node1, up=False)
        _, stderr = proc.communicate(timeout=FAILURE_BOUND + 30)
        took = time.monotonic() - start
    finally:
        proc.kill()
    # Open MPI's launcher may give up on node1 first, ending instances 0-1 with SIGTERM, and says why.
    assert proc.returncode in ((1,) if mpi == "mpich" else (1, 143)) and took < FAILURE_BOUND, stderr
    why = f"no word from it for {SILENCE_LIMIT:g} s: its host or the network to it is down" if mpi == "mpich" else ".+"
    assert re.search(rf"^poprun: host node1 was lost: instance\(s\) 2-3 there ended without an exit report \({why}\)$",
                     stderr, re.MULTILINE), stderr

    def of_the_job() -> list[str]:
        return [line for line in cluster.processes(node1)
                if marker in line or any(daemon in line for daemon in ("hydra_pmi_proxy", "prted"))]

    deadline = time.monotonic() + SILENCE_LIMIT + 10  # the stubs' own limit without an acknowledgement (Open MPI's
    # launcher may give up on node1 well before poprun does), and some
    while of_the_job() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert of_the_job() == []
    assert wait_no_processes(marker) == []  # nor anywhere else
    assert node1.sshd is not None
    files = [entry for place in ("tmp", "dev/shm") for entry in os.listdir(f"/proc/{node1.sshd.pid}/root/{place}")
             if entry.startswith(JOB_FILE_PREFIXES)]  # its own /tmp and /dev/shm, read while it is cut off
    assert files == []


@pytest.mark.parametrize("mpi,sig,status", [("mpich", signal.SIGINT, 130), ("mpich", signal.SIGTERM, 143),
                                            ("openmpi", signal.SIGTERM, 143)])
def test_signal_to_poprun_stops_every_host(cluster: Cluster, mpi: str, sig: int, status: int) -> None:
    marker = job_marker()
    proc = start_poprun(*mpi_args(mpi), "--num-instances", "4", "-H", "node0,node1", PYTHON, BEHAVE, marker,
                  env=job_env(mpi))
    try:
        wait_started(proc, 4)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == status, stderr
    assert f"interrupted by {signal.Signals(sig).name}" in stderr
    assert wait_no_processes(marker) == []


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_ctrl_z_stops_the_job_on_every_host_and_fg_continues_it(cluster: Cluster, mpi: str) -> None:
    """Ctrl-Z typed on poprun's terminal (a real bash on a pty): the programs on both hosts stop
    (state T, no progress), poprun stops, the shell has its terminal back; ``fg``: all go on, and
    the job ends with status 0 having shown every line."""
    marker = job_marker()
    with Shell(env=job_env(mpi)) as shell:
        shell.keys(" ".join([*POPRUN, *mpi_args(mpi), "--num-instances", "4", "-H", "node0,node1",
                             PYTHON, TICKER, str(COUNT), "0.02", marker]) + "\n")
        stop_and_continue(shell, marker, 4)
