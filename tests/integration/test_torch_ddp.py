"""Real torch under poprun: an unmodified DDP script (tests/scripts/ddp_train.py: gloo, env://
initialisation, torch's ``@record``) trains on one host with 2 and 4 instances, a rank killed
mid-run ends the job at once, ``--max-restarts`` resumes from the script's own checkpoint, and a
recorded failure's root cause reaches poprun's summary and ``--error-file``. (Across hosts:
tests/integration/test_multihost.py.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from functools import cache
from pathlib import Path

import pytest

from tests.helpers import OMP_SET, POPRUN, PYTHON, ROOT, job_marker, poprun, tagged_json, wait_no_processes
from tests.integration.cascade import CASCADE, check_cascade

pytestmark = pytest.mark.slow

DDP = str(ROOT / "tests" / "scripts" / "ddp_train.py")
#: Importing torch takes seconds per process, and the machine may have two cores for four of them.
TORCH_TIMEOUT = 120
#: A killed rank must end the job within this (the others are stopped: SIGTERM, then SIGKILL after 3 s).
PROMPTLY = 15.0


def ddp(instances: int, *args: str, poprun_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return poprun(*poprun_args, "--num-instances", str(instances), PYTHON, DDP, *args, timeout=TORCH_TIMEOUT)


@cache
def reference(instances: int, steps: int) -> str:
    """The parameters' hash of an uninterrupted run."""
    result = ddp(instances, "--steps", str(steps))
    assert result.returncode == 0, result.stderr
    hashes: set[str] = {report["params_sha256"] for report in tagged_json(result.stdout).values()}
    assert len(hashes) == 1, hashes
    return hashes.pop()


@pytest.mark.timeout(TORCH_TIMEOUT + 30)
@pytest.mark.parametrize("instances", [2, 4])
def test_ddp_trains_on_one_host(instances: int) -> None:
    result = ddp(instances, "--steps", "3")
    assert result.returncode == 0, result.stderr
    reports = tagged_json(result.stdout)
    assert sorted(reports) == list(range(instances))
    assert len({report["params_sha256"] for report in reports.values()}) == 1  # the script checked it too
    for rank, report in reports.items():
        env = report["env"]
        assert report["rank"] == rank and env["RANK"] == env["ROLE_RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(instances)
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("0", "1")
        assert env["MASTER_ADDR"] == "127.0.0.1"  # one host: torch's store is reached on loopback
        assert env["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // instances))
    assert len({report["env"]["MASTER_PORT"] for report in reports.values()}) == 1


def _wait_for(paths: list[Path], proc: subprocess.Popen[str]) -> None:
    """Until every path exists (each rank writes its own when it reaches the step): ordered by the
    script's files, not by a sleep."""
    deadline = time.monotonic() + TORCH_TIMEOUT
    while not all(path.exists() for path in paths):
        assert proc.poll() is None, f"poprun ended before the ranks held: {proc.communicate(timeout=30)}"
        assert time.monotonic() < deadline, f"the ranks never reached the step: {[str(p) for p in paths]}"
        time.sleep(0.05)


@pytest.mark.timeout(TORCH_TIMEOUT + 60)
def test_a_rank_killed_mid_run_ends_the_job_at_once(tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    marker = job_marker()  # in every process of the job's environment: poprun, mpiexec, stubs, programs
    proc = subprocess.Popen([*POPRUN, "--num-instances", "2", PYTHON, DDP, "--steps", "4", "--hold-at-step", "2",
                             "--marker-dir", str(markers)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        _wait_for([markers / "rank0", markers / "rank1"], proc)
        start = time.monotonic()
        os.kill(int((markers / "rank1").read_text()), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=PROMPTLY + 30)
        took = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == 128 + signal.SIGKILL, stderr
    assert took < PROMPTLY, f"took {took:.1f} s"
    lines = stderr.splitlines()
    assert any(line.startswith("poprun: instance 1 on ") and line.endswith(" failed: killed by SIGKILL (status 137)")
               for line in lines), stderr
    assert "poprun: stopped instance(s) 0 (1 of 2)" in lines
    assert wait_no_processes(marker) == []


@pytest.mark.timeout(2 * TORCH_TIMEOUT + 60)
def test_max_restarts_resumes_from_the_scripts_checkpoint(tmp_path: Path) -> None:
    """The first start fails on purpose at step 2; the restart loads the checkpoint of step 2 and
    ends with the parameters of a run that never failed."""
    checkpoint = tmp_path / "checkpoint.pt"
    result = ddp(2, "--steps", "4", "--checkpoint", str(checkpoint), "--fail-at-step", "2",
                 poprun_args=("--max-restarts", "1"))
    assert result.returncode == 0, result.stderr
    restarts = [line for line in result.stderr.splitlines() if line.startswith("poprun: restarting")]
    assert len(restarts) == 1, result.stderr
    assert restarts[0].startswith("poprun: restarting the job (1 of 1 restart(s)) in 1 s: instance 1 on ")
    assert restarts[0].endswith(" failed: exit status 1")
    reports = tagged_json(result.stdout)
    assert sorted(reports) == [0, 1]
    for report in reports.values():
        assert report["resumed_from"] == 2
        assert (report["env"]["TORCHELASTIC_RESTART_COUNT"], report["env"]["TORCHELASTIC_MAX_RESTARTS"]) == ("1", "1")
        assert report["params_sha256"] == reference(2, 4)


@pytest.mark.timeout(TORCH_TIMEOUT + 30)
def test_a_recorded_failure_shows_its_root_cause(tmp_path: Path) -> None:
    """torch's @record writes the exception to TORCHELASTIC_ERROR_FILE: its message and traceback
    (the raising function's name) are in poprun's summary and in --error-file."""
    error_file = tmp_path / "failure.json"
    result = ddp(2, "--steps", "3", "--fail-at-step", "1", poprun_args=("--error-file", str(error_file)))
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    at = lines.index("poprun: root cause (instance 1's error file): RuntimeError: step 1 failed on purpose")
    assert lines[at - 1].startswith("poprun: instance 1 on ") and lines[at - 1].endswith(" failed: exit status 1")
    traceback = lines[at + 2:lines.index("poprun: last lines of instance 1's stderr:")]
    assert lines[at + 1] == "poprun: its traceback:" and traceback[0] == "    Traceback (most recent call last):"
    assert any(line.endswith(", in fail_on_purpose") for line in traceback), traceback
    assert traceback[-1] == "    RuntimeError: step 1 failed on purpose"
    report = json.loads(error_file.read_text())[-1]
    assert report["instance"] == 1 and report["status"] == 1
    assert report["root_cause"]["message"] == "RuntimeError: step 1 failed on purpose"
    assert ", in fail_on_purpose\n" in report["root_cause"]["traceback"]


@pytest.mark.timeout(TORCH_TIMEOUT + 30)
@pytest.mark.parametrize("instances,linger", [(3, 0.5), (4, 3.0)])
def test_the_rank_that_raised_is_the_root_cause_not_the_first_to_exit(tmp_path: Path, instances: int,
                                                                       linger: float) -> None:
    """tests/scripts/cascade.py: rank 1 raises and destroys its process group; the others fail on
    the closed connections and exit while rank 1 lingers on its way out for ``linger`` seconds."""
    error_file = tmp_path / "failure.json"
    result = poprun("--error-file", str(error_file), "--num-instances", str(instances), PYTHON, CASCADE,
                    "--linger", str(linger), env=OMP_SET, timeout=TORCH_TIMEOUT)
    check_cascade(result, error_file, instances, 1, [socket.gethostname()] * instances)


@pytest.mark.timeout(TORCH_TIMEOUT + 30)
def test_the_rank_that_raised_is_the_root_cause_when_its_own_words_say_reset_by_peer(tmp_path: Path) -> None:
    """tests/scripts/cascade.py --error reset: rank 1's own ConnectionResetError ("reset by peer",
    raised in its own code) came first; its peers' gloo errors, recorded before it, are its
    consequences."""
    error_file = tmp_path / "failure.json"
    result = poprun("--error-file", str(error_file), "--num-instances", "3", PYTHON, CASCADE, "--linger", "0.5",
                    "--error", "reset", env=OMP_SET, timeout=TORCH_TIMEOUT)
    check_cascade(result, error_file, 3, 1, [socket.gethostname()] * 3,
                  "ConnectionResetError: [Errno 104] Connection reset by peer while loading batch 7")
