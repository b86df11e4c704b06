"""Hosts reached by a launcher agent that is not ssh, on the namespace cluster (``tests/cluster.py``).

The agent stands in for a ``kubectl exec`` wrapper: called as ``AGENT HOST COMMAND...`` it enters
the host's network, mount and UTS namespaces (``nsenter``) and runs the command there with a
shell, staying here as the local client, as kubectl does. Each call leaves a line in a log, and
the ``ssh`` on poprun's PATH is made to fail: a job that reached a host by ssh instead would fail,
and one that used the agent less often than once per remote host and start would be seen to.
MPICH (Hydra's rsh launcher with ``-launcher-exec``) and Open MPI (PRRTE's ``plm_ssh_agent``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import Cluster
from tests.helpers import (
    MARKER_VARIABLE,
    PYTHON,
    ROOT,
    job_marker,
    poprun,
    run,
    tagged_json,
    wait_no_processes,
)
from tests.integration.conftest import FAILURE_BOUND, job_env, job_files, lines_with, mpi_args, start_poprun

pytestmark = [pytest.mark.multihost, pytest.mark.slow, pytest.mark.usefixtures("nothing_left")]

MNIST = str(ROOT / "examples" / "mnist_rts.py")
WHERE = str(ROOT / "tests" / "scripts" / "where_and_what.py")
#: Says where each start put it; the first start waits to be ended, a later one ends at once.
PROGRAM = ("import os, time\n"
           "e = os.environ\n"
           "print(f\"start {e['POPDIST_RESTART_COUNT']}: {os.uname().nodename} instance {e['RANK']} of "
           "{e['WORLD_SIZE']}\", flush=True)\n"
           "if e['POPDIST_RESTART_COUNT'] == '0': time.sleep(120)\n")

#: The agent (its log's path comes in its environment, poprun's, which mpiexec passes on).
AGENT = """#!{python}
# netns-agent HOST COMMAND...: run COMMAND on HOST, a namespace of the test cluster (kubectl exec's stand-in).
import os, subprocess, sys

# Like ssh (closefrom), keep nothing of mpiexec's but the standard streams, unless told to keep all
# as a Go program such as kubectl does: the proxies there must not inherit mpiexec's listening socket.
if os.environ.get("NETNS_AGENT_KEEPS_FDS") != "1":
    os.closerange(3, 1 << 16)
host, command = sys.argv[1], " ".join(sys.argv[2:])
with open(os.environ["NETNS_AGENT_LOG"], "a") as log:
    log.write(host + "\\n")
namespaces = {namespaces!r}
if host not in namespaces:
    sys.exit(f"netns-agent: {{host}}: no such host")
own = os.readlink("/proc/self/ns/uts")
pids = subprocess.run(["ip", "netns", "pids", namespaces[host]], capture_output=True, text=True).stdout.split()
for pid in pids:
    try:  # a process with its host's hostname: past the unshare that gave the host its own /tmp too
        if os.readlink(f"/proc/{{pid}}/ns/uts") == own:
            continue
    except OSError:
        continue
    # stays here, the local end, as kubectl does; the command runs by a shell there, as ssh runs it
    status = subprocess.call(["nsenter", "-t", pid, "-n", "-m", "-u", "--", "sh", "-c", command])  # closes fds
    sys.exit(status if status >= 0 else 128 - status)  # killed there: as a shell says it
sys.exit(f"netns-agent: {{host}}: the host is down (nothing runs in its namespace)")
"""


@pytest.fixture
def agent(cluster: Cluster, tmp_path: Path) -> Iterator[tuple[str, Path, dict[str, str]]]:
    """The agent's path, its log, and the environment that disables ssh for poprun and mpiexec."""
    script = cluster.workdir / f"netns-agent-{uuid.uuid4().hex[:8]}"
    script.write_text(AGENT.format(python=PYTHON, namespaces={h.name: h.namespace for h in cluster.hosts}))
    script.chmod(0o755)
    log = tmp_path / "agent.log"
    log.touch()
    no_ssh = tmp_path / "no-ssh"
    no_ssh.mkdir()
    (no_ssh / "ssh").write_text(f"#!/bin/sh\necho \"$*\" >> {no_ssh / 'calls'}\n"
                                "echo \"ssh is disabled in this test: $*\" >&2\nexit 255\n")
    (no_ssh / "ssh").chmod(0o755)
    env = {"NETNS_AGENT_LOG": str(log), "PATH": f"{no_ssh}:{os.environ['PATH']}"}
    yield str(script), log, env
    script.unlink()


def _calls(log: Path) -> list[str]:
    return log.read_text().split()


def test_ssh_is_really_disabled_for_these_tests(cluster: Cluster, agent: tuple[str, Path, dict[str, str]]) -> None:
    """The check the other tests stand on: without the agent, the same job fails on ssh, which it
    ran (the disabled ssh keeps a list of its calls: Hydra may end before its words reach stderr)."""
    _, _, env = agent
    result = poprun(*mpi_args("mpich"), "--num-instances", "2", "-H", "node0,node1", PYTHON, WHERE,
                    env=job_env("mpich", **env), timeout=FAILURE_BOUND + 30)
    assert result.returncode != 0 and result.stdout == "", result.stderr
    calls = Path(env["PATH"].split(os.pathsep)[0], "calls").read_text()
    assert any(" node0 " in f" {call} " or " node1 " in f" {call} " for call in calls.splitlines()), calls


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_mnist_across_hosts_through_an_agent_is_bitwise_one_host(cluster: Cluster, mpi: str,
                                                                 agent: tuple[str, Path, dict[str, str]]) -> None:
    path, log, env = agent
    final = re.compile(r"final: test_accuracy=(\S+) weights_sha256=([0-9a-f]{64})")
    reference = run([PYTHON, MNIST, "--replication-factor", "4", "--epochs", "1"], timeout=120)
    assert reference.returncode == 0, reference.stderr
    result = poprun(*mpi_args(mpi), "-v", "--launcher-agent", path, "--num-instances", "2", "--num-replicas", "4",
                    "-H", "node0,node1", PYTHON, MNIST, "--epochs", "1", "--rts", env=job_env(mpi, **env),
                    timeout=180)
    assert result.returncode == 0, result.stderr
    assert f"reaching other hosts with {path} (--launcher-agent) instead of ssh" in result.stderr
    finals = final.findall(result.stdout)
    assert len(finals) == 2 and set(finals) == set(final.findall(reference.stdout)), result.stdout
    assert sorted(_calls(log)) == ["node0", "node1"]  # one proxy or daemon per host, each through the agent


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_the_variable_a_scheduler_sets_names_the_agent(cluster: Cluster, mpi: str,
                                                       agent: tuple[str, Path, dict[str, str]]) -> None:
    """The MPI Operator's (v1) OMPI_MCA_plm_rsh_agent, which Open MPI 5 no longer reads itself, and
    Hydra's HYDRA_LAUNCHER_EXEC: poprun hands either to either MPI."""
    path, log, env = agent
    variable = "OMPI_MCA_plm_rsh_agent" if mpi == "mpich" else "HYDRA_LAUNCHER_EXEC"
    result = poprun(*mpi_args(mpi), "-v", "--num-instances", "2", "-H", "node0,node1", PYTHON, WHERE,
                    env=job_env(mpi, **env, **{variable: path}), timeout=FAILURE_BOUND + 30)
    assert result.returncode == 0, result.stderr
    assert f"reaching other hosts with {path} ({variable}) instead of ssh" in result.stderr
    assert {i: r["host"] for i, r in tagged_json(result.stdout).items()} == {0: "node0", 1: "node1"}
    assert sorted(_calls(log)) == ["node0", "node1"]


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_a_host_lost_under_an_agent_is_left_out_of_the_restart(cluster: Cluster, mpi: str, tmp_path: Path,
                                                                agent: tuple[str, Path, dict[str, str]]) -> None:
    """node2 dies mid-job (every process of its namespace at once); the restart runs on node0 and
    node1, started through the agent again; nothing of either start is left on any host."""
    path, log, env = agent
    marker = job_marker()
    report = tmp_path / "attempts.json"
    proc = start_poprun(*mpi_args(mpi), "--launcher-agent", path, "--max-restarts", "1", "--restart-backoff", "0",
                        "--error-file", str(report), "--num-instances", "3", "--num-replicas", "6",
                        "-H", "node0,node1,node2", PYTHON, "-c", PROGRAM, marker, env=job_env(mpi, **env))
    try:
        lines_with(proc, "start 0:", 3)
        assert sorted(_calls(log)) == ["node0", "node1", "node2"]
        cluster.kill_host(cluster.host("node2"))
        out, err = proc.communicate(timeout=FAILURE_BOUND + 60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert sorted(line for line in out.splitlines() if "start 1:" in line) == [
        f"[{i}] start 1: node{i} instance {i} of 2" for i in range(2)]
    restarting = r"^poprun: restarting the job \(1 of 1 restart\(s\)\): host node2 was lost"
    assert re.search(restarting, err, re.MULTILINE), err
    assert "poprun: the restart runs on 2 host(s) without node2 (lost, tried again in 60 s)" in err
    # Nothing poprun says names ssh, which did not run. (Open MPI's launcher component is named ssh
    # whatever it runs, and under load says that a race with its child's exec failed a setpgid.)
    said = [line for line in err.splitlines() if not re.fullmatch(r"\[[^]]+\] plm:ssh: Warning: setpgid\(.*", line)]
    assert not any("ssh" in line for line in said), err
    failed, ended = json.loads(report.read_text())
    assert list(failed["lost_hosts"]) == ["node2"] and ended["status"] == 0
    assert sorted(_calls(log)) == ["node0", "node0", "node1", "node1", "node2"]  # the restart's through it too
    assert wait_no_processes(marker) == []
    assert {name: job_files(cluster, name) for name in ("node0", "node1")} == {"node0": [], "node1": []}


@pytest.mark.parametrize("mpi,keeps_fds", [("mpich", False), ("openmpi", False), ("mpich", True)])
def test_a_host_the_agent_cannot_reach_is_named_with_the_agents_words(cluster: Cluster, mpi: str, keeps_fds: bool,
                                                                      agent: tuple[str, Path, dict[str, str]]) -> None:
    """node1 is down before the job starts: the agent says so, and poprun's one line quotes it,
    naming the agent, not ssh. Hydra has started node0's proxy by then, which calls back after
    mpiexec has gone; an agent that keeps what it inherits (as kubectl does) holds mpiexec's
    listening socket, where that proxy would wait for ever, but not past poprun, which ends it."""
    path, _, env = agent
    env = {**env, "NETNS_AGENT_KEEPS_FDS": "1"} if keeps_fds else env
    marker = job_marker()
    cluster.kill_host(cluster.host("node1"))
    result = poprun(*mpi_args(mpi), "--launcher-agent", path, "--num-instances", "2", "-H", "node0,node1", PYTHON,
                    WHERE, marker, env=job_env(mpi, **env), timeout=FAILURE_BOUND + 30)
    assert result.returncode != 0
    name = os.path.basename(path)
    assert re.fullmatch(r"poprun: error: instance\(s\) [0-9, -]+ could not be started: host node1: "
                        rf"{name}: netns-agent: node1: the host is down \(nothing runs in its namespace\)\n",
                        result.stderr), result.stderr
    assert wait_no_processes(marker) == []


#: Wrappers of the agent that leave a helper running on poprun's machine when they exec it: in the
#: agent's process group, and in a session of its own. Each says its helper's PID first.
HELPERS = {"background": "sleep 1000 &", "own-session": "setsid sleep 1000 &"}


@pytest.mark.parametrize("helper", list(HELPERS))
@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_what_an_agent_leaves_running_here_ends_with_the_job(cluster: Cluster, mpi: str, helper: str, tmp_path: Path,
                                                             agent: tuple[str, Path, dict[str, str]]) -> None:
    """An agent (a wrapper script) that starts a helper in the background and execs the real agent:
    the helper outlives the agent. Whichever MPI ran the job, nothing of it is left when poprun ends."""
    path, log, env = agent
    helpers = tmp_path / "helpers"
    wrapper = tmp_path / "agent-with-a-helper"
    wrapper.write_text(f"#!/bin/sh\n{HELPERS[helper]}\necho $! >> {helpers}\nexec {path} \"$@\"\n")
    wrapper.chmod(0o755)
    marker = job_marker()
    try:
        result = poprun(*mpi_args(mpi), "--launcher-agent", str(wrapper), "--num-instances", "2", "-H",
                        "node0,node1", PYTHON, WHERE, marker, env=job_env(mpi, **env), timeout=FAILURE_BOUND + 30)
        assert result.returncode == 0, result.stderr
        assert sorted(_calls(log)) == ["node0", "node1"]
        started = helpers.read_text().split()
        assert len(started) == 2, started  # the wrapper said so before it started the agent: before the job ended
        assert wait_no_processes(marker) == []
        # Hydra waits on the pipes the helpers hold: poprun ends them once every instance has ended, and
        # says so. Open MPI's prterun does not wait: they are ended with the agents after it (said at -vv),
        # or, those in the job's session (the agent's process group), as what is left in that session.
        said = re.findall(r"POPRUN \[W\] killed process (\d+) \(sleep 1000\)(?:, which the launcher agent left "
                          r"running here| left behind in the job's session)$", result.stderr, re.MULTILINE)
        assert sorted(said) == sorted(started) if mpi == "mpich" else set(said) <= set(started), result.stderr
    finally:  # a helper left by a failure here is not left to the next test
        for pid in helpers.read_text().split() if helpers.exists() else ():
            if f"{MARKER_VARIABLE}={marker}" in _environ(pid):
                os.kill(int(pid), signal.SIGKILL)


def _environ(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return ""
