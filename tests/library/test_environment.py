"""The environment contract: what the launcher writes for instance i reads back, through
popdist_py, as exactly the plan's instance i; and docs/environment.md documents every variable."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from popcontract import environment
from popdist_py.topology import Topology, read_topology
from poprun_py.planning.mpi import CommandSpec, MpiLauncher, build_command, instance_environment
from poprun_py.planning.plan import InstancePlan, JobPlan
from tests.helpers import OPENMPI_LIBMPI, OPENMPI_MPIEXEC, PYTHON, ROOT, SUBPROCESS_TIMEOUT, poprun, tagged_json


def expected(plan: JobPlan, inst: InstancePlan) -> dict[str, object]:
    """The plan's instance, in the terms popdist_py answers in."""
    return {
        "num_total_replicas": plan.num_replicas,
        "num_local_replicas": inst.num_local_replicas,
        "replica_index_offset": inst.replica_index_offset,
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


def instance_environments(flavour: str, plan: JobPlan, spec: CommandSpec) -> list[dict[str, str]]:
    """The variables the mpiexec command poprun builds gives each instance: the job-wide ones
    (``-genv`` / ``-x`` before the app contexts) overlaid with the instance's own block."""
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


def torchrun_expected(plan: JobPlan, inst: InstancePlan) -> dict[str, str]:
    """torchrun's worker variables for the plan's instance: one role, one group per host."""
    expected = {
        "RANK": str(inst.index), "WORLD_SIZE": str(plan.num_instances), "LOCAL_RANK": str(inst.local_index),
        "LOCAL_WORLD_SIZE": str(plan.instances_per_host), "GROUP_RANK": str(plan.host_names.index(inst.host)),
        "GROUP_WORLD_SIZE": str(len(plan.host_names)), "ROLE_RANK": str(inst.index),
        "ROLE_WORLD_SIZE": str(plan.num_instances), "ROLE_NAME": "default", "MASTER_ADDR": plan.master_addr,
        "MASTER_PORT": str(plan.master_port), "TORCHELASTIC_RUN_ID": plan.run_id,
        "TORCHELASTIC_MAX_RESTARTS": str(plan.max_restarts), "TORCHELASTIC_RESTART_COUNT": str(plan.restart),
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    if plan.error_dir is not None:
        expected["TORCHELASTIC_ERROR_FILE"] = f"{plan.error_dir}/error-{inst.index}.json"
    return expected


@settings(max_examples=60, deadline=None)
@given(plans, st.sampled_from(["mpich", "openmpi"]), st.booleans(), st.integers(0, 3))
def test_what_the_launcher_writes_reads_back_as_the_plan(shape: tuple[int, int, int, int], flavour: str,
                                                         error_files: bool, restart: int) -> None:
    instances, replicas, ipus, num_hosts = shape
    hosts = tuple(f"node{h}" for h in range(num_hosts)) if num_hosts > 1 else ()
    plan = JobPlan(instances, replicas, ipus, hosts=hosts, master_addr="10.1.2.3", master_port=29511,
                   run_id="0123456789abcdef", max_restarts=3, error_dir="/tmp/poprun-0123" if error_files else None,
                   restart=restart)
    spec = CommandSpec(launch_env={environment.OMP_NUM_THREADS: "3"}, stub=("stub",), silence_limit=20,
                       control_address="10.1.2.4:5", explicit_hosts=bool(plan.hosts))
    envs = instance_environments(flavour, plan, spec)
    # What the command gives instance i is what the plan (and the launch's own variables) computes for it.
    assert envs == [instance_environment(plan, spec, i) for i in range(instances)]
    assert len(envs) == instances
    for inst, env in zip(plan.instances, envs, strict=True):
        assert seen(read_topology(env)) == expected(plan, inst)
        assert env[environment.RANK] == str(inst.index)
        assert env[environment.LOCAL_RANK] == str(inst.local_index)
        assert env[environment.WORLD_SIZE] == str(instances)
        assert env[environment.LOCAL_WORLD_SIZE] == str(plan.instances_per_host)
        torchrun = torchrun_expected(plan, inst)
        assert {name: env.get(name) for name in torchrun} == torchrun
        assert (environment.TORCHELASTIC_ERROR_FILE in env) == error_files
        assert env[environment.RESTART_COUNT] == str(restart)
        assert (env[environment.CONTROL], env[environment.OMP_NUM_THREADS]) == ("10.1.2.4:5", "3")


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


def _torchrun_launch(mpi: str, *args: str, env: dict[str, str] | None = None) -> tuple[dict[int, dict[str, Any]], str]:
    extra: list[str] = []
    env = dict(env or {})
    if mpi == "openmpi":
        if not OPENMPI_MPIEXEC.exists():
            pytest.fail(f"Open MPI is not installed at {OPENMPI_MPIEXEC} (make install puts it there)")
        extra, env["MPI4PY_LIBMPI"] = ["--mpi", str(OPENMPI_MPIEXEC)], str(OPENMPI_LIBMPI)
    result = poprun(*extra, *args, PYTHON, str(ROOT / "tests" / "scripts" / "torchrun_env.py"), env=env,
                    timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result.stderr
    return tagged_json(result.stdout), result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
@pytest.mark.parametrize("instances", [1, 4])
def test_real_instances_get_torchruns_contract_on_one_host(mpi: str, instances: int) -> None:
    """Every variable torchrun gives its workers, with torchrun's meaning: one host is group 0 of 1,
    MASTER_ADDR is loopback and MASTER_PORT a port found free there, one run id, a private error
    file per instance (removed with the job), and OMP_NUM_THREADS divided among a host's instances."""
    found, stderr = _torchrun_launch(mpi, "--num-instances", str(instances), "--max-restarts", "2")
    assert sorted(found) == list(range(instances))
    run_id = found[0]["env"]["TORCHELASTIC_RUN_ID"]
    port = found[0]["env"]["MASTER_PORT"]
    assert re.fullmatch(r"[0-9a-f]{16}", run_id) and 1 <= int(port) <= 65535
    plan = JobPlan(instances, instances, master_addr="127.0.0.1", master_port=port, run_id=run_id, max_restarts=2,
                   error_dir=f"/tmp/poprun-{run_id}")
    cores = found[0]["cores"]
    notice = [line for line in stderr.splitlines() if "OMP_NUM_THREADS" in line]
    for inst in plan.instances:
        report = found[inst.index]
        expected = {**torchrun_expected(plan, inst), "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                    "OMP_NUM_THREADS": str(max(1, cores // instances)) if instances > 1 else None}
        assert report["env"] == expected, inst.index
        assert report["error_file_writable"], inst.index
    assert not Path(f"/tmp/poprun-{run_id}").exists()  # the job's error files went with it
    if instances > 1:
        assert notice == [(f"poprun: OMP_NUM_THREADS is not set: each instance gets its host's usable cores divided "
                           f"by the {instances} instances there, at least 1 (torchrun sets 1); here {cores} / "
                           f"{instances} = {max(1, cores // instances)}")]
    else:
        assert notice == []  # torchrun too sets it only for several workers


@pytest.mark.slow
@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_what_the_user_sets_wins(mpi: str) -> None:
    """The user's OMP_NUM_THREADS and TORCH_NCCL_ASYNC_ERROR_HANDLING reach every instance untouched
    (Open MPI forwards nothing unless told), and --master-port is MASTER_PORT; nothing is said."""
    found, stderr = _torchrun_launch(mpi, "--num-instances", "3", "--master-port", "29555",
                                     env={"OMP_NUM_THREADS": "7", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
                                          "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "1"})
    assert stderr == ""
    for report in found.values():
        env = report["env"]
        assert (env["OMP_NUM_THREADS"], env["TORCH_NCCL_ASYNC_ERROR_HANDLING"]) == ("7", "0")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29555")  # poprun's, as torchrun's


def test_the_docs_list_every_variable_and_only_those() -> None:
    """docs/environment.md's table of environment variables names each variable of the contract once."""
    text = (ROOT / "docs" / "environment.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    documented = [name for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]*[A-Za-z0-9_]*)`", row.split("|")[1])]
    assert sorted(documented) == sorted(v.name for v in environment.VARIABLES)


def test_each_name_is_written_once() -> None:
    """No module but the contract spells a variable's name as a string literal of its own."""
    names = [v.name for v in environment.VARIABLES]
    assert len(names) == len(set(names))
    sources = [p for p in (*ROOT.glob("poprun_py/**/*.py"), *ROOT.glob("popdist_py/**/*.py"),
                           *ROOT.glob("popcontract/**/*.py")) if p != ROOT / "popcontract" / "environment.py"]
    assert len(sources) > 80, "the sources were not found"
    for variable in environment.VARIABLES:
        spelled = [str(p.relative_to(ROOT)) for p in sources
                   if re.search(rf"""["']{variable.name}["']""", p.read_text())]
        assert spelled == [], f"{variable.name} is spelled out again in {spelled}"
