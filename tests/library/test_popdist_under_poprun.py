"""popdist_py end to end through ``poprun``: values per instance, failures, collectives, subsets."""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.helpers import PYTHON, ROOT, job_marker, poprun, wait_no_processes

pytestmark = pytest.mark.slow  # every test launches poprun

JOB = str(ROOT / "tests" / "scripts" / "failsafe_job.py")


def test_popdist_api_values_per_instance() -> None:
    code = ("import json, popdist_py as p; print(json.dumps([p.isPopdistEnvSet(), p.getNumTotalReplicas(), "
            "p.getNumLocalReplicas(), p.getReplicaIndexOffset(), p.getNumInstances(), p.getInstanceIndex(), "
            "p.getLocalInstanceIndex(), p.getNumIpusPerReplica(), p.getDeviceId(), p.checkNumIpusPerReplica(2)]))")
    result = poprun("--num-instances", "3", "--num-replicas", "6", "--ipus-per-replica", "2", PYTHON, "-c", code)
    assert result.returncode == 0, result.stderr
    values = {int(line[1]): json.loads(line[4:]) for line in result.stdout.splitlines()}
    assert values == {i: [True, 6, 2, 2 * i, 3, i, i, 2, i, True] for i in range(3)}


@pytest.mark.parametrize("mode,status,evidence", [
    ("raise", 1, "RuntimeError: boom from instance 1"),
    ("raise_reduce", 1, "RuntimeError: boom from instance 1"),
    ("thread", 1, "ZeroDivisionError"),
    ("exit3", 3, "exit status 3"),
    ("raise_exit3", 3, "exit status 3"),
])
def test_failures_end_the_job_fast_with_their_status(mode: str, status: int, evidence: str) -> None:
    marker = job_marker()  # in every process of the job's environment: poprun, mpiexec, stubs, programs
    start = time.monotonic()
    result = poprun("--num-instances", "3", PYTHON, JOB, mode, f"--marker={marker}")
    elapsed = time.monotonic() - start
    assert result.returncode == status, result.stderr
    # Stopped at once (about a second with mpiexec's start-up, a few on a loaded 2-core host) vs hung:
    # the waiting instances would wait until poprun's timeout (SUBPROCESS_TIMEOUT, 60 s), or in the
    # thread mode until instance 1's 30 s sleep ends. 15 s separates the two.
    assert elapsed < 15, f"took {elapsed:.1f}s"
    assert "poprun: instance 1 on " in result.stderr
    assert evidence in result.stderr
    assert "instance 0: done" not in result.stdout  # the others were stopped, not released
    assert wait_no_processes(marker) == []


def test_caught_exit_and_normal_collectives_succeed() -> None:
    caught = poprun("--num-instances", "2", PYTHON, JOB, "exit_caught")
    assert caught.returncode == 0, caught.stderr
    assert "[1] instance 1: caught SystemExit 3" in caught.stdout
    ok = poprun("--num-instances", "3", PYTHON, JOB, "ok")
    assert ok.returncode == 0, ok.stderr
    # sum over 3 instances of arange(6)+r = 15*3 + 6*(0+1+2) = 63
    assert sorted(ok.stdout.splitlines()) == [f"[{i}] instance {i}: ok 63.0 [0, 1, 2]" for i in range(3)]


def test_mismatched_shapes_are_named_on_every_instance() -> None:
    result = poprun("--num-instances", "2", PYTHON, JOB, "mismatch")
    assert result.returncode == 0, result.stderr
    for i in (0, 1):
        line = next(line for line in result.stdout.splitlines() if line.startswith(f"[{i}] "))
        assert "instance 0 (3, 4)" in line and "instance 1 (4,)" in line, line


def test_a_peer_that_never_arrives_is_named_after_the_timeout() -> None:
    marker = job_marker()
    start = time.monotonic()
    result = poprun("--num-instances", "3", PYTHON, JOB, "late", f"--marker={marker}",
                    env={"POPDIST_COLLECTIVE_TIMEOUT": "1"})
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    assert elapsed < 10
    assert "CollectiveTimeoutError" in result.stderr and re.search(r"instance 1\b", result.stderr)
    assert wait_no_processes(marker) == []


def test_execute_on_instances_subset_of_three() -> None:
    result = poprun("--num-instances", "3", PYTHON, JOB, "subset")
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.splitlines())
    # On {0, 2}: allreduce of rank+1 = 1 + 3 = 4; gathered ranks [0, 2]; the inner {2}-only call
    # returns 7.0 on instance 2 and None on instance 0. Instance 1 gets None.
    assert "[0] instance 0: subset result [4.0, [0, 2], None]" in lines
    assert "[2] instance 2: subset result [4.0, [0, 2], np.float64(7.0)]" in lines
    assert "[1] instance 1: subset result None" in lines
    assert "[0] instance 0: again [2.0, [0, 2], None]" in lines


def test_distributed_sampler_defaults_shard_by_instance() -> None:
    code = ("import json; from popdist_py.data import DistributedSampler as S; s = S(10, seed=3); s.set_epoch(2); "
            "print(json.dumps(list(s)))")
    result = poprun("--num-instances", "3", "--num-replicas", "6", PYTHON, "-c", code)
    assert result.returncode == 0, result.stderr
    shards = {int(line[1]): json.loads(line[4:]) for line in result.stdout.splitlines()}
    assert sorted(shards) == [0, 1, 2] and all(len(s) == 4 for s in shards.values())  # ceil(10/3)
    everything = [i for s in shards.values() for i in s]
    assert set(everything) == set(range(10)) and len(everything) == 12  # padded with 2 repeats
