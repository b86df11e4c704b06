"""The engine through ``poprun``: any split of the same replicas trains to the same bits."""

from __future__ import annotations

import os
import re

import pytest

from popcontract.environment import ENGINE_EXECUTOR as ENV
from tests.helpers import POPRUN, PYTHON, ROOT, poprun, run

TRAIN = str(ROOT / "tests" / "scripts" / "engine_train.py")

pytestmark = pytest.mark.slow  # every test launches poprun


def hashes(stdout: str) -> set[str]:
    found = re.findall(r"weights-sha256 ([0-9a-f]{64}) ", stdout)
    assert found, stdout
    return set(found)


@pytest.mark.parametrize("replicas,splits", [(4, [2, 4]), (6, [2, 3])])
def test_every_split_trains_to_identical_weights(replicas: int, splits: list[int], executor: str) -> None:
    single = run([PYTHON, TRAIN, "--replicas", str(replicas), "--steps", "6"])
    assert single.returncode == 0, single.stderr
    reference = hashes(single.stdout)
    assert len(reference) == 1
    for instances in splits:
        result = poprun("--num-instances", str(instances), "--num-replicas", str(replicas),
                        PYTHON, TRAIN, "--steps", "6", timeout=120)
        assert result.returncode == 0, result.stderr
        lines = [line for line in result.stdout.splitlines() if "weights-sha256" in line]
        assert len(lines) == instances  # every instance reports, all the same
        assert hashes(result.stdout) == reference, f"{instances} instances x {replicas // instances} replicas"
        assert f"replicas={replicas} instances={instances}" in lines[0]
        assert all(line.endswith(f"executor={executor}") for line in lines)  # the override reaches instances


@pytest.mark.parametrize("instances,cpus,expect", [
    (1, 2, "threads"),      # 2 cores to itself: the threshold, threads
    (1, 1, "cooperative"),  # 1 core: below it
    (2, 2, "cooperative"),  # 2 cores shared by 2 instances (LOCAL_WORLD_SIZE=2): 1 each, below it
    (2, 4, "threads"),      # 4 cores shared by 2: 2 each, the threshold again
])
def test_auto_executor_counts_the_instances_sharing_the_host(instances: int, cpus: int, expect: str,
                                                            executor: str) -> None:
    """Without an override each instance applies the auto rule (threads when it has at least 2 cores
    to itself) to the CPUs it may run on (its affinity, set here with taskset and inherited through
    poprun and mpiexec) divided by poprun's LOCAL_WORLD_SIZE: both sides of the threshold."""
    if executor != "threads":
        pytest.skip("independent of the module's executor")
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < cpus:
        pytest.skip(f"needs {cpus} CPUs, this process may use {len(usable)}")
    replicas = 4 * instances  # 4 local replicas per instance
    result = run(["taskset", "-c", ",".join(map(str, usable[:cpus])), *POPRUN, "--num-instances", str(instances),
                  "--num-replicas", str(replicas), PYTHON, TRAIN, "--steps", "1"], env={ENV: ""}, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "weights-sha256" in line]
    assert len(lines) == instances and all(line.endswith(f"executor={expect}") for line in lines), result.stdout
