"""A program started by a bare MPI launcher (``mpiexec -n N``, ``srun``), not by poprun: popdist_py
answers as N instances of one replica each, from the launcher's own variables, and says so once."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from popcontract import environment as names
from popcontract.settings import PopdistEnvError
from popdist_py.topology import read_topology
from tests.helpers import MPICH_MPIEXEC, OPENMPI_LIBMPI, OPENMPI_MPIEXEC, PYTHON, ROOT, run

WHERE = """
import json, sys, numpy as np, popdist_py as p
answer = json.dumps({"index": p.getInstanceIndex(), "instances": p.getNumInstances(), "local": p.getNumLocalReplicas(),
                  "offset": p.getReplicaIndexOffset(), "total": p.getNumTotalReplicas(),
                  "local_index": p.getLocalInstanceIndex(), "set": p.isPopdistEnvSet(),
                  "sum": p.allreduce(np.ones(1)).tolist()})
open(f"{sys.argv[1]}/{p.getInstanceIndex()}.json", "w").write(answer)  # bare mpiexec mixes stdout lines
"""


@pytest.mark.parametrize(("env", "want"), [
    ({names.PMI_RANK: "1", names.PMI_SIZE: "3", names.MPI_LOCALRANKID: "1"}, (3, 1, 1, "MPICH (Hydra)")),
    ({names.OMPI_RANK: "2", names.OMPI_SIZE: "4", names.OMPI_LOCAL_RANK: "0"}, (4, 2, 0, "Open MPI")),
    ({names.PMIX_RANK: "5", names.SLURM_NTASKS: "8", names.SLURM_LOCALID: "1"}, (8, 5, 1, "srun with PMIx")),
    ({names.PMI_RANK: "3", names.PMI_SIZE: "4", names.SLURM_LOCALID: "1"}, (4, 3, 1, "MPICH (Hydra)")),  # srun pmi2
])
def test_each_launchers_variables_give_n_instances_of_one_replica(env: dict[str, str],
                                                                  want: tuple[int, int, int, str]) -> None:
    topo = read_topology(env)
    assert (topo.num_instances, topo.instance_index, topo.local_instance_index, topo.source) == want
    assert topo.num_local_replicas == 1 and topo.num_total_replicas == want[0] and not topo.is_set


def test_poprun_environment_wins_over_the_launchers() -> None:
    env = {names.PMI_RANK: "0", names.PMI_SIZE: "2", names.NUM_TOTAL_REPLICAS: "8",
           names.NUM_LOCAL_REPLICAS: "4", names.REPLICA_INDEX_OFFSET: "0"}
    topo = read_topology(env)
    assert (topo.num_instances, topo.num_local_replicas, topo.source) == (2, 4, "poprun")


@pytest.mark.parametrize("env", [
    {names.PMIX_RANK: "0"}, {names.PMI_RANK: "1"}, {names.OMPI_RANK: "3"},  # a rank without a size
    {names.SLURM_NTASKS: "4"},  # inside a Slurm allocation, but not started by srun
])
def test_half_a_launchers_variables_is_no_launch(env: dict[str, str]) -> None:
    topo = read_topology(env)
    assert (topo.num_instances, topo.instance_index, topo.source) == (1, 0, "")


def test_a_launch_of_one_rank_is_one_instance() -> None:
    topo = read_topology({names.PMI_RANK: "0", names.PMI_SIZE: "1"})
    assert (topo.num_instances, topo.instance_index, topo.source) == (1, 0, "MPICH (Hydra)")


@pytest.mark.parametrize(("env", "message"), [
    ({names.PMI_RANK: "2", names.PMI_SIZE: "2"}, "PMI_RANK=2 is not below PMI_SIZE=2"),
    ({names.OMPI_RANK: "x", names.OMPI_SIZE: "2"}, "OMPI_COMM_WORLD_RANK='x' is not an integer"),
])
def test_bad_launcher_variables_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(PopdistEnvError, match=re.escape(message)):
        read_topology(env)


def _answers(folder: Path) -> list[dict[str, Any]]:
    return sorted((json.loads(f.read_text()) for f in folder.glob("*.json")), key=lambda a: a["index"])


@pytest.mark.slow
@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_bare_mpiexec_gives_popdist_its_instances(mpi: str, tmp_path: Path) -> None:
    if mpi == "mpich":
        cmd, env = [str(MPICH_MPIEXEC), "-n", "3"], {}
    else:
        cmd, env = [str(OPENMPI_MPIEXEC), "--allow-run-as-root", "--oversubscribe", "-n", "3"], {
            "MPI4PY_LIBMPI": str(OPENMPI_LIBMPI)}
    done = run([*cmd, PYTHON, "-c", WHERE, str(tmp_path)], env=env)
    assert done.returncode == 0, done.stderr
    got = _answers(tmp_path)
    assert [(a["index"], a["instances"], a["local"], a["offset"], a["total"], a["set"], a["sum"]) for a in got] == \
        [(i, 3, 1, i, 3, True, [3.0]) for i in range(3)]
    assert sorted(a["local_index"] for a in got) == [0, 1, 2]  # one host
    said = [line for line in done.stderr.splitlines() if "without poprun" in line]
    assert len(said) == 1 and "3 instances of one replica each" in said[0], done.stderr


@pytest.mark.slow
def test_mnist_under_bare_mpiexec_equals_its_replicas_in_one_process() -> None:
    """The example no longer trains twice alone: 2 processes are 2 replicas of one job."""
    script = str(ROOT / "examples" / "mnist_rts.py")
    bare = run([str(MPICH_MPIEXEC), "-n", "2", PYTHON, script, "--epochs", "2"], timeout=120)
    one = run([PYTHON, script, "--epochs", "2", "--replication-factor", "2"], timeout=120)
    assert bare.returncode == 0 and one.returncode == 0, bare.stderr + one.stderr
    finals = re.findall(r"weights_sha256=(\w{64})", bare.stdout)
    assert len(finals) == 2 and set(finals) == set(re.findall(r"weights_sha256=(\w{64})", one.stdout))


@pytest.mark.slow
def test_an_explicit_replication_stays_in_its_process() -> None:
    """``Runtime(replication=R)`` without ``comm`` is R replicas in this process, as it always was
    without poprun; ``Runtime()`` takes the launcher's processes."""
    program = ("from popdist_py.engine import Runtime\n"
               "with Runtime(replication=4) as a, Runtime() as b:\n"
               "    got = (a.num_instances, a.replication_factor, b.num_instances, b.replication_factor)\n"
               "assert got == (1, 4, 2, 2), got")
    done = run([str(MPICH_MPIEXEC), "-n", "2", PYTHON, "-c", program])
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("env", [{names.PMI_RANK: "1", names.PMI_SIZE: "2"},
                                 {names.PMI_RANK: "0", names.PMI_SIZE: "2", names.SLURM_LOCALID: "0"}])
def test_without_a_local_rank_the_instance_is_first_on_its_host(env: dict[str, str]) -> None:
    assert read_topology(env).local_instance_index == 0


def test_rank_0_of_a_bare_launch_says_once_what_it_was_given(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    from popdist_py import topology as popdist_topology

    def said(rank: str, size: str) -> list[tuple[str, str, str]]:
        monkeypatch.setattr(popdist_topology, "_announced", False)
        monkeypatch.setenv(names.PMI_RANK, rank)
        monkeypatch.setenv(names.PMI_SIZE, size)
        caplog.clear()
        read_topology()
        read_topology()
        return [(r.name, r.levelname, r.getMessage()) for r in caplog.records]

    for name in (names.NUM_TOTAL_REPLICAS, names.NUM_LOCAL_REPLICAS, names.REPLICA_INDEX_OFFSET):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level("WARNING", logger="popdist_py"):
        message = ("popdist_py: started by MPICH (Hydra) without poprun (PMI_SIZE=2): 2 instances of one replica "
                   "each; poprun sets the replicas per instance")
        assert said("0", "2") == [("popdist_py", "WARNING", message)]
        assert said("1", "2") == []  # the other ranks say nothing
        assert said("0", "1") == []  # one process: nothing to say
        caplog.clear()
        read_topology({names.PMI_RANK: "0", names.PMI_SIZE: "2"})  # an environment given, not this process's
        assert caplog.records == []


def test_poprun_s_variables_alone_give_the_optional_ones_their_defaults() -> None:
    topo = read_topology({names.NUM_TOTAL_REPLICAS: "8", names.NUM_LOCAL_REPLICAS: "4",
                          names.REPLICA_INDEX_OFFSET: "4"})
    assert topo.is_set is True and topo.source == "poprun"
    assert (topo.num_instances, topo.instance_index, topo.ipus_per_replica, topo.local_instance_index) == (2, 1, 1, 0)


def test_poprun_s_variables_in_part_are_one_line_naming_what_is_missing_and_what_is_set() -> None:
    with pytest.raises(PopdistEnvError) as info:
        read_topology({names.NUM_TOTAL_REPLICAS: "4"})
    assert str(info.value) == (f"incomplete PopDist environment: {names.NUM_LOCAL_REPLICAS}, "
                               f"{names.REPLICA_INDEX_OFFSET} missing while {names.NUM_TOTAL_REPLICAS}='4' is set")
    with pytest.raises(PopdistEnvError) as info:
        read_topology({names.NUM_TOTAL_REPLICAS: "4", names.REPLICA_INDEX_OFFSET: "2"})
    assert str(info.value) == (f"incomplete PopDist environment: {names.NUM_LOCAL_REPLICAS} missing while "
                               f"{names.NUM_TOTAL_REPLICAS}='4', {names.REPLICA_INDEX_OFFSET}='2' are set")


@pytest.mark.parametrize(("total", "local", "offset", "message"), [
    ("2", "4", "0", "POPDIST_NUM_LOCAL_REPLICAS=4 exceeds POPDIST_NUM_TOTAL_REPLICAS=2"),
    ("6", "4", "0", "POPDIST_NUM_TOTAL_REPLICAS=6 is not a multiple of POPDIST_NUM_LOCAL_REPLICAS=4"),
    ("8", "4", "2", "POPDIST_REPLICA_INDEX_OFFSET=2 is not a multiple of POPDIST_NUM_LOCAL_REPLICAS=4"),
    ("8", "4", "8", ("POPDIST_REPLICA_INDEX_OFFSET=8 + POPDIST_NUM_LOCAL_REPLICAS=4 exceeds "
                     "POPDIST_NUM_TOTAL_REPLICAS=8")),
])
def test_replica_counts_that_cannot_hold_are_named(total: str, local: str, offset: str, message: str) -> None:
    with pytest.raises(PopdistEnvError) as info:
        read_topology({names.NUM_TOTAL_REPLICAS: total, names.NUM_LOCAL_REPLICAS: local,
                       names.REPLICA_INDEX_OFFSET: offset})
    assert str(info.value) == message


POPRUN_ENV = {names.NUM_TOTAL_REPLICAS: "8", names.NUM_LOCAL_REPLICAS: "4", names.REPLICA_INDEX_OFFSET: "4"}


COUNTS = "(POPDIST_NUM_TOTAL_REPLICAS=8, POPDIST_NUM_LOCAL_REPLICAS=4, POPDIST_REPLICA_INDEX_OFFSET=4)"


@pytest.mark.parametrize(("extra", "message"), [
    ({names.UNIFORM_REPLICAS: "2"}, f"{names.UNIFORM_REPLICAS}='2' must be 0 or 1"),
    ({names.NUM_INSTANCES: "3"}, f"POPDIST_NUM_INSTANCES=3 contradicts the replica counts, which give 2 {COUNTS}"),
    ({names.INSTANCE_INDEX: "0"}, f"POPDIST_INSTANCE_INDEX=0 contradicts the replica counts, which give 1 {COUNTS}"),
])
def test_the_derived_variables_must_agree_with_the_counts(extra: dict[str, str], message: str) -> None:
    with pytest.raises(PopdistEnvError) as info:
        read_topology({**POPRUN_ENV, **extra})
    assert str(info.value) == message


@pytest.mark.parametrize("uniform", ["", "0", "1"])
def test_uniform_replicas_may_be_empty_0_or_1(uniform: str) -> None:
    assert read_topology({**POPRUN_ENV, names.UNIFORM_REPLICAS: uniform}).num_instances == 2
