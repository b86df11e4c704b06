"""The environment contract: what the launcher writes for instance i reads back, through
popdist_py, as exactly the plan's instance i; and the README documents every variable."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from popdist_py.env import Topology, read_topology
from poprun_py import environment
from poprun_py.mpi import CommandSpec, MpiLauncher, build_command
from poprun_py.plan import InstancePlan, JobPlan
from tests.helpers import OPENMPI_LIBMPI, OPENMPI_MPIEXEC, PYTHON, ROOT, SUBPROCESS_TIMEOUT, poprun, tagged_json


def expected(plan: JobPlan, inst: InstancePlan) -> dict[str, object]:
    """The plan's instance, in the terms popdist_py answers in."""
    return {
        "num_total_replicas": plan.num_replicas,
        "num_local_replicas": inst.num_local_replicas,
        "replica_index_offset": inst.replica_offset,
        "ipus_per_replica": plan.ipus_per_replica,
        "num_instances": plan.num_instances,
        "instance_index": inst.index,
        "local_instance_index": inst.local_index,
        "local_replicas": [inst.replicas.start, inst.replicas.stop],
    }


def seen(topology: Topology) -> dict[str, object]:
    return {
        "num_total_replicas": topology.num_total_replicas,
        "num_local_replicas": topology.num_local_replicas,
        "replica_index_offset": topology.replica_index_offset,
        "ipus_per_replica": topology.ipus_per_replica,
        "num_instances": topology.num_instances,
        "instance_index": topology.instance_index,
        "local_instance_index": topology.local_instance_index,
        "local_replicas": [topology.local_replicas.start, topology.local_replicas.stop],
    }


def instance_environments(flavour: str, plan: JobPlan) -> list[dict[str, str]]:
    """The variables the mpiexec command poprun builds gives each instance: the job-wide ones
    (``-genv`` / ``-x`` before the app contexts) overlaid with the instance's own block."""
    spec = CommandSpec(job_env=plan.job_env(), instance_envs=[plan.instance_env(i) for i in range(plan.num_instances)],
                       shim=["shim"], program=["prog"], explicit_hosts=bool(plan.hosts))
    command = build_command(MpiLauncher("mpiexec", flavour, "test"), plan, spec)  # type: ignore[arg-type]

    def variables(tokens: list[str]) -> dict[str, str]:
        found, i = {}, 0
        while i < len(tokens):
            if flavour == "mpich" and tokens[i] in ("-genv", "-env"):
                found[tokens[i + 1]] = tokens[i + 2]
                i += 3
            elif flavour == "openmpi" and tokens[i] == "-x" and "=" in tokens[i + 1]:
                name, value = tokens[i + 1].split("=", 1)
                found[name] = value
                i += 2
            else:
                i += 1
        return found

    common = variables(command.tail)
    return [{**common, **variables(block)} for block in command.blocks]


plans = st.integers(1, 12).flatmap(lambda instances: st.tuples(
    st.just(instances),
    st.integers(1, 4).map(lambda k: instances * k),
    st.integers(1, 3),
    st.sampled_from([d for d in range(1, instances + 1) if instances % d == 0]),
))


@settings(max_examples=60, deadline=None)
@given(plans, st.sampled_from(["mpich", "openmpi"]))
def test_what_the_launcher_writes_reads_back_as_the_plan(shape: tuple[int, int, int, int], flavour: str) -> None:
    instances, replicas, ipus, num_hosts = shape
    hosts = tuple(f"node{h}" for h in range(num_hosts)) if num_hosts > 1 else ()
    plan = JobPlan(instances, replicas, ipus, hosts=hosts)
    envs = instance_environments(flavour, plan)
    assert len(envs) == instances
    for inst, env in zip(plan.instances, envs, strict=True):
        assert seen(read_topology(env)) == expected(plan, inst)
        assert env[environment.RANK] == str(inst.index)
        assert env[environment.LOCAL_RANK] == str(inst.local_index)
        assert env[environment.WORLD_SIZE] == str(instances)
        assert env[environment.LOCAL_WORLD_SIZE] == str(plan.instances_per_host)


@pytest.mark.slow
@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_real_instances_see_the_plan(mpi: str) -> None:
    extra: list[str] = []
    env: dict[str, str] = {}
    if mpi == "openmpi":
        if not OPENMPI_MPIEXEC.exists():
            pytest.fail(f"Open MPI is not installed at {OPENMPI_MPIEXEC} (make install puts it there)")
        extra, env = ["--mpi", str(OPENMPI_MPIEXEC)], {"MPI4PY_LIBMPI": str(OPENMPI_LIBMPI)}
    result = poprun(*extra, "--num-instances", "3", "--num-replicas", "6", "--ipus-per-replica", "2",
                    PYTHON, str(ROOT / "tests" / "scripts" / "placement.py"), env=env, timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr
    plan = JobPlan(3, 6, 2)
    assert tagged_json(result.stdout) == {inst.index: expected(plan, inst) for inst in plan.instances}


def test_the_readme_lists_every_variable_and_only_those() -> None:
    """The README's table of environment variables names each variable of the contract once."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    documented = [name for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]*[A-Za-z0-9_]*)`", row.split("|")[1])]
    assert sorted(documented) == sorted(v.name for v in environment.VARIABLES)


def test_each_name_is_written_once() -> None:
    """No module but the contract spells a variable's name as a string literal of its own."""
    names = [v.name for v in environment.VARIABLES]
    assert len(names) == len(set(names))
    sources = [p for p in (*ROOT.glob("poprun_py/*.py"), *ROOT.glob("popdist_py/**/*.py"))
               if p.name != "environment.py"]
    for variable in environment.VARIABLES:
        spelled = [str(p.relative_to(ROOT)) for p in sources
                   if re.search(rf"""["']{variable.name}["']""", p.read_text())]
        assert spelled == [], f"{variable.name} is spelled out again in {spelled}"
