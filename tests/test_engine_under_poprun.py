"""The engine through ``poprun``: any split of the same replicas trains to the same bits."""

from __future__ import annotations

import re

import pytest

from popdist_py.engine.executor import ENV, available_cores
from tests.helpers import PYTHON, ROOT, poprun, run

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


def test_auto_executor_counts_the_instances_sharing_the_host(executor: str) -> None:
    """Without an override each instance applies the auto rule with poprun's LOCAL_WORLD_SIZE."""
    if executor != "threads":
        pytest.skip("independent of the module's executor")
    result = poprun("--num-instances", "2", "--num-replicas", "4", PYTHON, TRAIN, "--steps", "1",
                    env={ENV: ""}, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "weights-sha256" in line]
    expect = "threads" if available_cores() // 2 >= 2 else "cooperative"  # 2 replicas per instance
    assert len(lines) == 2 and all(line.endswith(f"executor={expect}") for line in lines), result.stdout
