"""A launcher agent instead of ssh, without launching: which agent is used (--launcher-agent, else
the variable a scheduler or the MPI Operator set), how each MPI is handed it (and no ssh options),
its one line when it cannot run, and the launcher's output read with the agent's name.
(``tests/integration/test_launcher_agent.py`` runs jobs through one on the namespace cluster.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from poprun_py.planning.agent import Agent, find_agent
from poprun_py.planning.mpi import CommandSpec, MpiLauncher, build_command
from poprun_py.planning.plan import JobPlan
from poprun_py.shared.errors import PlanError
from poprun_py.supervision.host_errors import host_failures
from tests.helpers import poprun

VARIABLES = ("PRTE_MCA_plm_ssh_agent", "OMPI_MCA_plm_rsh_agent", "HYDRA_LAUNCHER_EXEC", "HYDRA_LAUNCHER",
             "HYDRA_LAUNCHER_EXTRA_ARGS", "PRTE_MCA_plm_ssh_args")


@pytest.fixture(autouse=True)
def no_agent_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def agent(tmp_path: Path) -> str:
    path = tmp_path / "kubexec.sh"
    path.write_text("#!/bin/sh\nexec kubectl exec \"$1\" -- /bin/sh -c \"$*\"\n")
    path.chmod(0o755)
    return str(path)


def test_the_option_wins_then_the_first_variable_set(monkeypatch: pytest.MonkeyPatch, agent: str,
                                                     tmp_path: Path) -> None:
    assert find_agent(None) is None  # ssh
    other = tmp_path / "other"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    monkeypatch.setenv("HYDRA_LAUNCHER_EXEC", str(other))
    assert find_agent(None) == Agent(str(other), "HYDRA_LAUNCHER_EXEC")
    monkeypatch.setenv("OMPI_MCA_plm_rsh_agent", agent)  # the MPI Operator's (v1)
    assert find_agent(None) == Agent(agent, "OMPI_MCA_plm_rsh_agent")
    monkeypatch.setenv("PRTE_MCA_plm_ssh_agent", str(other))
    assert find_agent(None) == Agent(str(other), "PRTE_MCA_plm_ssh_agent")
    assert find_agent(agent) == Agent(agent, "--launcher-agent")
    found = find_agent("sh")  # a name on PATH
    assert found is not None and found.path.startswith("/") and found.path.endswith("/sh")


def test_hydras_other_launchers_keep_their_program(monkeypatch: pytest.MonkeyPatch, agent: str) -> None:
    """HYDRA_LAUNCHER=slurm with HYDRA_LAUNCHER_EXEC=srun: Hydra's own launcher, not an agent."""
    monkeypatch.setenv("HYDRA_LAUNCHER_EXEC", agent)
    monkeypatch.setenv("HYDRA_LAUNCHER", "slurm")
    assert find_agent(None) is None
    monkeypatch.setenv("HYDRA_LAUNCHER", "rsh")
    assert find_agent(None) == Agent(agent, "HYDRA_LAUNCHER_EXEC")


#: The variables that name an agent, first to last in find_agent's precedence.
AGENT_VARIABLES = ("PRTE_MCA_plm_ssh_agent", "OMPI_MCA_plm_rsh_agent", "HYDRA_LAUNCHER_EXEC")


@pytest.mark.parametrize("value", ["ssh", "/usr/bin/ssh", "ssh -x", "ssh -o LogLevel=ERROR", "ssh : rsh"])
@pytest.mark.parametrize("variable", [*AGENT_VARIABLES, "--launcher-agent"])
def test_an_agent_that_is_ssh_itself_is_poprun_s_ssh(monkeypatch: pytest.MonkeyPatch, agent: str, variable: str,
                                                   value: str) -> None:
    """A profile's ``OMPI_MCA_plm_rsh_agent='ssh -x'`` (or Open MPI's default list, 'ssh : rsh') is
    no agent: the hosts are reached with ssh and poprun's options for it, not refused for its spaces;
    and an agent that a variable after it names is not taken instead."""
    if variable == "--launcher-agent":
        for name in AGENT_VARIABLES:  # the option wins over them all
            monkeypatch.setenv(name, agent)
        assert find_agent(value) is None
        return
    monkeypatch.setenv(variable, value)
    for later in AGENT_VARIABLES[AGENT_VARIABLES.index(variable) + 1:]:
        monkeypatch.setenv(later, agent)
    assert find_agent(None) is None


@pytest.mark.slow  # starts poprun
def test_a_profiles_ssh_agent_with_options_gives_a_multi_host_plan_with_poprun_s_ssh() -> None:
    result = poprun("--num-instances", "2", "-H", "n0,n1", "--dry-run", "/bin/true",
                    env={"OMPI_MCA_plm_rsh_agent": "ssh -x"})
    assert result.returncode == 0, result.stderr
    assert "-launcher-exec" not in result.stdout and "BatchMode=yes" in result.stdout, result.stdout


@pytest.mark.parametrize("value,why", [
    ("/no/such/agent", "does not exist"), ("no-such-agent-on-path", "is not on PATH"), ("/tmp", "is not a file"),
    ("kubectl exec", "is not on PATH: put its options in a wrapper script")])
def test_an_agent_that_cannot_run_is_one_line(value: str, why: str) -> None:
    with pytest.raises(PlanError) as refused:
        find_agent(value)
    assert str(refused.value).startswith(f"--launcher-agent {value!r} {why}; a launcher agent is one program that "
                                         "mpiexec runs as 'AGENT HOST COMMAND...' to run COMMAND on HOST")


def test_a_file_that_is_not_executable_is_refused_by_the_variable_that_named_it(monkeypatch: pytest.MonkeyPatch,
                                                                              tmp_path: Path) -> None:
    script = tmp_path / "kubexec.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    monkeypatch.setenv("OMPI_MCA_plm_rsh_agent", str(script))
    with pytest.raises(PlanError, match=rf"^OMPI_MCA_plm_rsh_agent='{script}' is not executable; a launcher agent"):
        find_agent(None)


def _command(flavour: str, agent: str | None, callback: str | None = "10.0.0.1",
             global_args: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str]]:
    plan = JobPlan(2, 2, hosts=("node0", "node1") if callback else ())
    launcher = MpiLauncher(f"/opt/{flavour}/bin/mpiexec", flavour, "5")  # type: ignore[arg-type]
    built = build_command(launcher, plan, CommandSpec(launch_env={}, stub=("stub",), silence_limit=20,
                                                      explicit_hosts=bool(callback),
                                                      callback_address=callback, launcher_agent=agent,
                                                      global_args=global_args))
    return built.argv(), built.env


def _after(argv: list[str], option: str) -> list[str]:
    at = argv.index(option)
    return argv[at:at + 4]


def test_each_mpi_is_handed_the_agent_its_own_way_and_no_ssh_options(agent: str) -> None:
    argv, env = _command("mpich", agent)
    assert _after(argv, "-launcher") == ["-launcher", "rsh", "-launcher-exec", agent]
    assert "HYDRA_LAUNCHER_EXTRA_ARGS" not in env
    argv, env = _command("openmpi", agent)
    assert _after(argv, "plm_ssh_agent")[:2] == ["plm_ssh_agent", agent]
    assert _after(argv, "plm_ssh_no_tree_spawn")[:2] == ["plm_ssh_no_tree_spawn", "1"]
    assert "PRTE_MCA_plm_ssh_args" not in env
    # ssh: its options, and no agent
    argv, env = _command("mpich", None)
    assert "-launcher" not in argv and env["HYDRA_LAUNCHER_EXTRA_ARGS"].startswith("-o ConnectTimeout=10")
    argv, env = _command("openmpi", None)
    assert "plm_ssh_agent" not in argv and env["PRTE_MCA_plm_ssh_args"].startswith("-o ConnectTimeout=10")


def test_one_host_needs_no_agent(agent: str) -> None:
    argv, _ = _command("mpich", agent, callback=None)
    assert "-launcher" not in argv


@pytest.mark.parametrize("global_args,launcher,ssh", [
    ((), None, True), (("-verbose",), None, True), ((), "ssh", True),
    (("-launcher", "lsf"), None, False), (("-bootstrap", "slurm"), None, False),
    (("-launcher-exec", "/opt/x"), None, False), (("-bootstrap-exec", "/opt/x"), None, False), ((), "slurm", False)])
def test_hydra_with_another_launcher_gets_no_ssh_options(monkeypatch: pytest.MonkeyPatch, global_args: tuple[str, ...],
                                                         launcher: str | None, ssh: bool) -> None:
    """ssh's options would be handed to srun or blaunch: Hydra gets them only where it uses ssh (no
    launcher of the user's in HYDRA_LAUNCHER or --mpi-global-args, whatever else those hold)."""
    if launcher is not None:
        monkeypatch.setenv("HYDRA_LAUNCHER", launcher)
    _, env = _command("mpich", None, global_args=global_args)
    assert ("HYDRA_LAUNCHER_EXTRA_ARGS" in env) == ssh


KUBECTL_GONE = """Error from server (NotFound): pods "job-worker-1" not found
[mpiexec@launcher] ui_cmd_cb (pmiserv_pmci.c:51): Launch proxy failed.
[mpiexec@launcher] main (mpiexec.c:270): process manager error waiting for completion
"""
OPENMPI_BOX = """------------------------------------------------------------
A daemon failed to report back after being spawned.

  Local host:    launcher
  Remote host:   job-worker-1
  Daemon exit status: 1

------------------------------------------------------------
error: unable to upgrade connection: container not found ("mpi")
"""


def test_the_agents_words_name_the_host_and_the_agent() -> None:
    hosts = ["job-worker-0", "job-worker-1"]
    assert host_failures(KUBECTL_GONE, hosts, ["job-worker-1"], "kubexec.sh") == {
        "job-worker-1": 'kubexec.sh: Error from server (NotFound): pods "job-worker-1" not found'}
    # A line that names no host goes to the hosts that never started, when nothing else names one ...
    assert host_failures(OPENMPI_BOX.split("----\n", 2)[-1], hosts, ["job-worker-1"], "kubexec.sh") == {
        "job-worker-1": 'kubexec.sh: error: unable to upgrade connection: container not found ("mpi")'}
    # ... and Open MPI's box names the host, its words not taken for the agent's.
    assert host_failures(OPENMPI_BOX, hosts, ["job-worker-1"], "kubexec.sh") == {
        "job-worker-1": "Open MPI's daemon there did not call back (exit status 1)"}
    # With ssh, nothing but ssh's own messages count.
    assert host_failures(KUBECTL_GONE, hosts, ["job-worker-1"]) == {}
    assert host_failures("netns-agent: node1: down\n", ["node1", "node10"], [], "a") == {
        "node1": "a: netns-agent: node1: down"}


@pytest.mark.slow  # starts poprun
def test_dry_run_shows_the_agent_handed_to_mpiexec(agent: str) -> None:
    result = poprun("-v", "--dry-run", "--launcher-agent", agent, "--num-instances", "2", "-H", "node0,node1",
                    "/bin/true")
    assert result.returncode == 0, result.stderr
    assert f"reaching other hosts with {agent} (--launcher-agent) instead of ssh" in result.stderr
    assert f" -launcher rsh -launcher-exec {agent} " in result.stdout
    refused = poprun("--dry-run", "--launcher-agent", "/no/agent", "--num-instances", "2", "/bin/true")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1  # the option: even on one host
    assert refused.stderr.startswith("poprun: error: --launcher-agent '/no/agent' does not exist; ")
    # A variable that names an agent is read only where there are hosts to reach: a profile's setting
    # does not stop a job on this machine.
    unset = {"PRTE_MCA_plm_ssh_agent": "kubexec.sh --namespace ml"}
    assert poprun("--dry-run", "--num-instances", "2", "/bin/true", env=unset).returncode == 0
    refused = poprun("--dry-run", "--num-instances", "2", "-H", "node0,node1", "/bin/true", env=unset)
    assert refused.returncode == 2 and refused.stderr.startswith(
        "poprun: error: PRTE_MCA_plm_ssh_agent='kubexec.sh --namespace ml' is not on PATH: put its options in a "
        "wrapper script; ")
