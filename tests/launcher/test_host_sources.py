"""The hosts a scheduler gives, each read from its real variable in its real format (Slurm, PBS/Torque,
LSF, Grid Engine, the Kubernetes MPI Operator), the precedence between them, the slots that bound
a host's instances, and one line for each bad file."""

from __future__ import annotations

from pathlib import Path

import pytest

from poprun_py.planning.host_sources import PRECEDENCE, Found, from_environment
from poprun_py.planning.hosts import abridged, read_host_file
from poprun_py.planning.plan import JobPlan
from poprun_py.shared.errors import PlanError
from poprun_py.supervision.restarts import Layout, Restarts
from tests.helpers import poprun

VARIABLES = [name for source in PRECEDENCE for name in (source.variable, source.slots_variable) if name]


@pytest.fixture(autouse=True)
def no_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the variables it reads; none comes from the environment pytest runs in."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _file(tmp_path: Path, text: str, name: str = "hosts") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


#: Each source by its variable and its real format: the hosts in order and their slots.
FORMATS = [
    ("SLURM_JOB_NODELIST", None, "node[01-02],gpu7", Found(["node01", "node02", "gpu7"], {})),
    # PBS/Torque: one line per slot; `-l nodes=2:ppn=2` may list a host's slots apart
    ("PBS_NODEFILE", "n0.cluster\nn1.cluster\nn0.cluster\nn1.cluster\n", None,
     Found(["n0.cluster", "n1.cluster"], {"n0.cluster": 2, "n1.cluster": 2})),
    ("LSB_DJOB_HOSTFILE", "hostA\nhostA\nhostA\nhostB\n", None, Found(["hostA", "hostB"], {"hostA": 3, "hostB": 1})),
    ("LSB_MCPU_HOSTS", None, "hostA 4 hostB 2", Found(["hostA", "hostB"], {"hostA": 4, "hostB": 2})),
    # Grid Engine: host slots queue processor-range; a host in two queues has the slots of both
    ("PE_HOSTFILE", ("n0.example.org 2 all.q@n0.example.org UNDEFINED\nn1.example.org 1 all.q@n1 UNDEFINED\n"
                    "n1.example.org 1 gpu.q@n1 <NULL>\n"), None,
     Found(["n0.example.org", "n1.example.org"], {"n0.example.org": 2, "n1.example.org": 2})),
    # The MPI Operator: Open MPI's `host slots=N` (its launcher's pod name and the workers'), Hydra's `host:N`
    ("OMPI_MCA_orte_default_hostfile", ("job-worker-0.job-worker.ns.svc slots=2\njob-worker-1.job-worker.ns.svc "
                                       "slots=2\n"), None,
     Found(["job-worker-0.job-worker.ns.svc", "job-worker-1.job-worker.ns.svc"],
           {"job-worker-0.job-worker.ns.svc": 2, "job-worker-1.job-worker.ns.svc": 2})),
    ("HYDRA_HOST_FILE", "job-worker-0:4\njob-worker-1:4\n", None,
     Found(["job-worker-0", "job-worker-1"], {"job-worker-0": 4, "job-worker-1": 4})),
]


@pytest.mark.parametrize("variable,file_text,value,found", FORMATS, ids=[f[0] for f in FORMATS])
def test_each_source_is_read_from_its_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, variable: str,
                                               file_text: str | None, value: str | None, found: Found) -> None:
    given = _file(tmp_path, file_text) if file_text is not None else value
    assert given is not None
    monkeypatch.setenv(variable, given)
    chosen = from_environment()
    assert chosen is not None and chosen.source.variable == variable
    assert chosen.found == found
    assert chosen.warning == ""
    slots = f" (slots: {abridged(', '.join(f'{h}:{n}' for h, n in found.slots.items()))})" if found.slots else ""
    assert chosen.said == (f"no -H/--host-file: using the {len(found.hosts)} host(s) {chosen.source.scheduler} gives "
                           f"in {variable}={given}{slots}")


@pytest.mark.parametrize("tasks,slots", [("2(x2),1", [2, 2, 1]), ("1(x3)", [1, 1, 1]), ("1,4,2", [1, 4, 2]),
                                         (" 3(x03)", [3, 3, 3])])
def test_slurms_tasks_per_node_are_its_hosts_slots(monkeypatch: pytest.MonkeyPatch, tasks: str,
                                                   slots: list[int]) -> None:
    """``SLURM_TASKS_PER_NODE`` counts the tasks of each host of the node list in its order (what
    ``sbatch -N3 -n5`` or ``--ntasks-per-node`` give), the form mpirun reads its slots from under Slurm."""
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-3]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", tasks)
    chosen = from_environment()
    assert chosen is not None and chosen.found == Found(["n1", "n2", "n3"], dict(zip(["n1", "n2", "n3"], slots,
                                                                                     strict=True)))
    shown = ", ".join(f"n{i + 1}:{n}" for i, n in enumerate(slots))
    assert chosen.said == (f"no -H/--host-file: using the 3 host(s) Slurm gives in SLURM_JOB_NODELIST=n[1-3] and "
                           f"SLURM_TASKS_PER_NODE={tasks} (slots: {shown})")


#: SLURM_TASKS_PER_NODE's one line for each way it can be wrong, with 3 hosts in the node list.
FORM = ("it is 'N' or 'N(xM)' items joined by commas in the order of SLURM_JOB_NODELIST's hosts, N a host's tasks "
        "(a whole number from 1), M how many hosts in a row have N (e.g. '2(x3),1')")
BAD_TASKS = [
    ("2(x2)", "SLURM_TASKS_PER_NODE '2(x2)' gives the tasks of fewer hosts than the 3 of SLURM_JOB_NODELIST; " + FORM),
    ("1,1,1,1", "SLURM_TASKS_PER_NODE '1,1,1,1' gives the tasks of more hosts than the 3 of SLURM_JOB_NODELIST"),
    ("1(x" + "9" * 5000 + ")", "gives the tasks of more hosts than the 3 of SLURM_JOB_NODELIST"),
    ("2(x", "SLURM_TASKS_PER_NODE '2(x': '2(x' is not 'N' or 'N(xM)'; " + FORM),
    # an item never closed, its count of hosts read nowhere; shown cut at 20 characters
    ("1(x" + "3" * 30, f"SLURM_TASKS_PER_NODE '1(x{'3' * 30}': '1(x{'3' * 17}...' is not 'N' or 'N(xM)'; " + FORM),
    ("1(x0),1,1", "SLURM_TASKS_PER_NODE '1(x0),1,1': '1(x0)' is not 'N' or 'N(xM)'"),
    ("0(x3)", "SLURM_TASKS_PER_NODE '0(x3)' gives '0' slots; " + FORM),
    ("two,1,1", "SLURM_TASKS_PER_NODE 'two,1,1' gives 'two' slots"),
]


@pytest.mark.parametrize("tasks,message", BAD_TASKS, ids=[bad[0][:10] for bad in BAD_TASKS])
def test_a_bad_slurm_tasks_per_node_is_one_line(monkeypatch: pytest.MonkeyPatch, tasks: str, message: str) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-3]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", tasks)
    with pytest.raises(PlanError) as refused:
        from_environment()
    assert message in str(refused.value) and "\n" not in str(refused.value) and len(str(refused.value)) < 600


def test_no_source_set_is_this_machine() -> None:
    assert from_environment() is None


def test_the_first_source_wins_and_a_disagreement_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    pbs = _file(tmp_path, "n0\nn1\n", "pbs")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[0-2]")
    monkeypatch.setenv("PBS_NODEFILE", pbs)
    monkeypatch.setenv("PE_HOSTFILE", _file(tmp_path, "n0 1 q UNDEFINED\nn1 1 q UNDEFINED\nn2 1 q UNDEFINED\n", "pe"))
    chosen = from_environment()
    assert chosen is not None and chosen.found.hosts == ["n0", "n1", "n2"]
    # Grid Engine agrees with Slurm: only PBS is named.
    assert chosen.warning == (f"Slurm's SLURM_JOB_NODELIST=n[0-2] gives n0,n1,n2, but PBS's PBS_NODEFILE={pbs} gives "
                              "n0,n1: using Slurm's (the first of Slurm, PBS, LSF, Grid Engine, the MPI Operator)")
    assert "\n" not in chosen.warning
    monkeypatch.delenv("SLURM_JOB_NODELIST")
    chosen = from_environment()
    assert chosen is not None and chosen.source.scheduler == "PBS" and chosen.found.hosts == ["n0", "n1"]
    assert chosen.warning.startswith(f"PBS's PBS_NODEFILE={pbs} gives n0,n1, but Grid Engine's PE_HOSTFILE=")


def test_a_losing_source_that_cannot_be_read_is_named_not_fatal(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[0-1]")
    monkeypatch.setenv("PBS_NODEFILE", str(tmp_path / "gone"))
    monkeypatch.setenv("PE_HOSTFILE", pe := _file(tmp_path, "n0 1 q UNDEFINED\n", "pe"))  # the sources after it too
    chosen = from_environment()
    assert chosen is not None and chosen.found.hosts == ["n0", "n1"]
    gone = tmp_path / "gone"
    assert (f"but PBS's PBS_NODEFILE file '{gone}' cannot be read: No such file or directory; Grid Engine's "
            f"PE_HOSTFILE={pe} gives n0: using Slurm's") in chosen.warning


def test_lsfs_two_forms_of_one_list_do_not_disagree(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LSB_DJOB_HOSTFILE", _file(tmp_path, "hA\nhA\nhB\nhB\n"))
    monkeypatch.setenv("LSB_MCPU_HOSTS", "hA 2 hB 2")
    chosen = from_environment()
    assert chosen is not None and chosen.source.variable == "LSB_DJOB_HOSTFILE" and chosen.warning == ""
    # The list is never compared with LSF's own file; every other pair is, the sources after it too.
    monkeypatch.setenv("LSB_MCPU_HOSTS", "hA 4")
    monkeypatch.setenv("PE_HOSTFILE", _file(tmp_path, "hC 1 q UNDEFINED\n", "pe"))
    chosen = from_environment()
    assert chosen is not None and chosen.source.variable == "LSB_DJOB_HOSTFILE"
    assert "LSB_MCPU_HOSTS" not in chosen.warning and "but Grid Engine's PE_HOSTFILE=" in chosen.warning
    monkeypatch.setenv("SLURM_JOB_NODELIST", "hA,hB")
    chosen = from_environment()
    assert chosen is not None and chosen.source.scheduler == "Slurm"
    assert "LSF's LSB_MCPU_HOSTS=hA 4 gives hA; " in chosen.warning and "LSB_DJOB_HOSTFILE" not in chosen.warning


#: A bad file or value: one line naming the file, the line and what is valid.
BAD = [
    ("PBS_NODEFILE", "n0\nn0 n1\n", None, ("PBS_NODEFILE file '{path}' line 2: 'n0 n1' is not one host name; each "
                                          "line is one host name, a host's name once per slot")),
    ("PBS_NODEFILE", "", None, "PBS_NODEFILE file '{path}' lists no hosts"),
    ("LSB_DJOB_HOSTFILE", "\n# nothing\n", None, "LSB_DJOB_HOSTFILE file '{path}' lists no hosts"),
    ("LSB_MCPU_HOSTS", None, "hostA 4 hostB", ("LSB_MCPU_HOSTS 'hostA 4 hostB' has 3 words; it is 'host1 n1 host2 n2 "
                                              "...', each n the host's slots, a whole number from 1")),
    ("LSB_MCPU_HOSTS", None, "hostA 0", "LSB_MCPU_HOSTS 'hostA 0' gives '0' slots; it is 'host1 n1 host2 n2 ...'"),
    ("PE_HOSTFILE", "n0 2 all.q UNDEFINED\nn1\n", None,
     ("PE_HOSTFILE file '{path}' line 2: 'n1' has no slots; each line is 'host slots queue processor-range', slots a "
     "whole number from 1")),
    ("PE_HOSTFILE", "n0 0 all.q UNDEFINED\n", None,
     ("PE_HOSTFILE file '{path}' line 1: 'n0 0 all.q UNDEFINED' gives '0' slots; each line is 'host slots queue "
     "processor-range', slots a whole number from 1 (at most 65536)")),
    ("OMPI_MCA_orte_default_hostfile", "w0 slots=2\nw1 slots=two\n", None,
     ("OMPI_MCA_orte_default_hostfile file '{path}' line 2: 'w1 slots=two' gives 'two' slots; each line is "
      "'host', 'host slots=N' or 'host:N', with N a whole number from 1 (at most 65536)")),
    ("HYDRA_HOST_FILE", "w0:0\n", None, "HYDRA_HOST_FILE file '{path}' line 1: 'w0:0' gives '0' slots"),
]


@pytest.mark.parametrize("variable,file_text,value,message", BAD)
def test_a_bad_source_is_one_line_naming_the_file_and_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          variable: str, file_text: str | None, value: str | None,
                                                          message: str) -> None:
    path = _file(tmp_path, file_text) if file_text is not None else None
    given = path if path is not None else value
    assert given is not None
    monkeypatch.setenv(variable, given)
    with pytest.raises(PlanError) as refused:
        from_environment()
    assert message.format(path=path) in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("variable", ["PBS_NODEFILE", "LSB_DJOB_HOSTFILE", "PE_HOSTFILE",
                                      "OMPI_MCA_orte_default_hostfile", "HYDRA_HOST_FILE"])
def test_a_missing_or_unreadable_file_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                  variable: str) -> None:
    monkeypatch.setenv(variable, str(tmp_path / "gone"))
    with pytest.raises(PlanError, match=rf"^{variable} file '{tmp_path}/gone' cannot be read: No such "
                                        r"file or directory$"):
        from_environment()
    monkeypatch.setenv(variable, str(tmp_path))  # a directory: root reads any file, but no directory
    with pytest.raises(PlanError, match=rf"'{tmp_path}' cannot be read: Is a directory$"):
        from_environment()


def test_a_file_is_named_whole_and_a_list_cut_at_200_characters(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    folder = tmp_path / ("d" * 220)
    folder.mkdir()
    monkeypatch.setenv("PBS_NODEFILE", path := _file(folder, "n0\n"))
    chosen = from_environment()
    assert chosen is not None and f"gives in PBS_NODEFILE={path} (slots: n0:1)" in chosen.said
    monkeypatch.delenv("PBS_NODEFILE")
    nodes, tasks = ",".join(f"node{i:03d}" for i in range(40)), ",".join(["1(x001)"] * 40)
    monkeypatch.setenv("SLURM_JOB_NODELIST", nodes)
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", tasks)
    chosen = from_environment()
    assert chosen is not None and (f"gives in SLURM_JOB_NODELIST={nodes[:200]}... and SLURM_TASKS_PER_NODE="
                                   f"{tasks[:200]}... (slots: ") in chosen.said


def test_grid_engines_lines_need_only_a_host_and_its_slots(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PE_HOSTFILE", _file(tmp_path, "n0 2\nn1 1 all.q UNDEFINED\n"))
    chosen = from_environment()
    assert chosen is not None and chosen.found == Found(["n0", "n1"], {"n0": 2, "n1": 1})


@pytest.mark.parametrize("variable,holds", [("PBS_NODEFILE", "one host name per line, one line per slot"),
                                            ("LSB_DJOB_HOSTFILE", "one host name per line, one line per slot"),
                                            ("PE_HOSTFILE", "'host slots queue processor-range' lines")])
def test_a_file_of_too_many_lines_is_one_line_saying_what_its_lines_are(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path, variable: str,
                                                                       holds: str) -> None:
    path = _file(tmp_path, "\n" * ((1 << 20) + 1))
    monkeypatch.setenv(variable, path)
    with pytest.raises(PlanError) as refused:
        from_environment()
    assert str(refused.value) == f"{variable} file '{path}' has more than 1048576 lines; it holds {holds}"


def test_a_host_file_gives_slots_in_either_form(tmp_path: Path) -> None:
    path = _file(tmp_path, "# workers\nw[0-1] slots=2 max_slots=4\nw2:3  # Hydra's form\nw3\n")
    assert read_host_file(path) == (["w0", "w1", "w2", "w3"], {"w0": 2, "w1": 2, "w2": 3})


def test_restarts_keep_to_the_slots_the_source_gave() -> None:
    """20 replicas, 4 instances on each of 5 hosts; n4 is lost: 5 replicas per host left, which
    4 instances do not divide; without slots a host gets 5 instances, with 4 slots 1."""
    hosts = [f"n{i}" for i in range(5)]
    plan = JobPlan(20, 20, hosts=tuple(hosts))
    unbounded = Restarts.for_plan(plan, 1, 60.0, None)
    bounded = Restarts.for_plan(plan, 1, 60.0, None, dict.fromkeys(hosts, 4))
    current = Layout(20, hosts)
    assert unbounded.next_layout(current, {"n4": "lost"}, now=0.0)[0] == Layout(20, hosts[:4])
    assert bounded.next_layout(current, {"n4": "lost"}, now=0.0)[0] == Layout(4, hosts[:4])


# ------------------------------------------------------------------ through poprun (a dry run)
@pytest.mark.slow  # starts poprun
def test_poprun_says_which_source_it_used_and_places_by_it(tmp_path: Path) -> None:
    pbs = _file(tmp_path, "n0\nn0\nn1\nn1\n", "pbs")
    both = {"PBS_NODEFILE": pbs, "SLURM_JOB_NODELIST": "n[0-2]", "PE_HOSTFILE": ""}  # empty: not set
    result = poprun("-v", "--num-instances", "3", "--dry-run", "/bin/true", env=both)
    assert result.returncode == 0, result.stderr
    assert "no -H/--host-file: using the 3 host(s) Slurm gives in SLURM_JOB_NODELIST=n[0-2]" in result.stderr
    warnings = [line for line in result.stderr.splitlines() if "[W]" in line]
    assert len(warnings) == 1 and f"but PBS's PBS_NODEFILE={pbs} gives n0,n1: using Slurm's" in warnings[0]
    assert "-hosts n0:1,n1:1,n2:1" in result.stdout
    # Slurm's hosts, not PBS's: 4 instances do not spread over them.
    assert "cannot be spread evenly over 3 hosts" in poprun("--num-instances", "4", "--dry-run", "/bin/true",
                                                            env=both).stderr
    result = poprun("-v", "--num-instances", "4", "--dry-run", "/bin/true", env={"PBS_NODEFILE": pbs})
    assert result.returncode == 0, result.stderr
    assert "using the 2 host(s) PBS gives in PBS_NODEFILE=" + pbs + " (slots: n0:2, n1:2)" in result.stderr
    assert "  instance 1 on n0 (local index 1)" in result.stdout and "  instance 2 on n1 (local index 0)" \
        in result.stdout
    assert "-hosts n0:2,n1:2" in result.stdout


@pytest.mark.slow  # starts poprun
def test_instances_that_do_not_fit_the_slots_are_one_line(tmp_path: Path) -> None:
    pe = _file(tmp_path, "n0 2 all.q UNDEFINED\nn1 1 all.q UNDEFINED\n", "pe")
    refused = poprun("--num-instances", "4", "--dry-run", "/bin/true", env={"PE_HOSTFILE": pe})
    assert (refused.returncode, refused.stderr) == (2, (
        f"poprun: error: PE_HOSTFILE={pe} (Grid Engine) gives n1:1: fewer slots than the 2 instances per host that "
        "4 instances on 2 hosts need\n"))
    hosts = _file(tmp_path, "w0 slots=1\nw1 slots=1\n", "mpi-operator")
    refused = poprun("--num-instances", "4", "--host-file", hosts, "--dry-run", "/bin/true")
    assert (refused.returncode, refused.stderr) == (2, (
        f"poprun: error: host file {hosts} gives w0:1, w1:1: fewer slots than the 2 instances per host that "
        "4 instances on 2 hosts need\n"))
    assert poprun("--num-instances", "2", "--host-file", hosts, "--dry-run", "/bin/true").returncode == 0
    bad = _file(tmp_path, "n0\nn0 n1\n", "pbs")
    refused = poprun("--num-instances", "2", "--dry-run", "/bin/true", env={"PBS_NODEFILE": bad})
    assert (refused.returncode, refused.stderr) == (2, (
        f"poprun: error: PBS_NODEFILE file '{bad}' line 2: 'n0 n1' is not one host name; each line is one host name, "
        "a host's name once per slot\n"))


@pytest.mark.slow  # starts poprun
def test_slurms_tasks_bound_the_instances_of_each_host() -> None:
    """``salloc -N2`` (one task per node) refuses 4 instances in one line naming Slurm's variables;
    ``--ntasks-per-node=2`` places them 2 a host."""
    one = {"SLURM_JOB_NODELIST": "n[0-1]", "SLURM_TASKS_PER_NODE": "1(x2)"}
    refused = poprun("--num-instances", "4", "--dry-run", "/bin/true", env=one)
    assert (refused.returncode, refused.stderr) == (2, (
        "poprun: error: SLURM_JOB_NODELIST=n[0-1] and SLURM_TASKS_PER_NODE=1(x2) (Slurm) gives n0:1, n1:1: fewer "
        "slots than the 2 instances per host that 4 instances on 2 hosts need\n"))
    result = poprun("--num-instances", "4", "--dry-run", "/bin/true", env={**one, "SLURM_TASKS_PER_NODE": "2(x2)"})
    assert result.returncode == 0, result.stderr
    assert "-hosts n0:2,n1:2" in result.stdout


@pytest.mark.slow  # starts poprun
@pytest.mark.parametrize("variable,file_text,value", [("LSB_DJOB_HOSTFILE", "hA\nhA\nhB\nhB\n", None),
                                                      ("LSB_MCPU_HOSTS", None, "hA 2 hB 2")])
def test_lsfs_hosts_reach_the_plan(tmp_path: Path, variable: str, file_text: str | None, value: str | None) -> None:
    """LSF's allocation, not on the namespace cluster: the plan and the mpiexec command it gives."""
    given = _file(tmp_path, file_text) if file_text is not None else value
    assert given is not None
    result = poprun("-v", "--num-instances", "4", "--dry-run", "/bin/true", env={variable: given})
    assert result.returncode == 0, result.stderr
    assert f"using the 2 host(s) LSF gives in {variable}={given} (slots: hA:2, hB:2)" in result.stderr
    assert "-hosts hA:2,hB:2" in result.stdout
    refused = poprun("--num-instances", "6", "--dry-run", "/bin/true", env={variable: given})
    assert refused.returncode == 2 and "gives hA:2, hB:2: fewer slots than the 3 instances per host" in refused.stderr
