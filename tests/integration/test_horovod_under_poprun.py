"""Unmodified Horovod programs under ``poprun --horovod`` on one host: ``import horovod.torch``
finds popdist_py's API (and an installed Horovod wins), a job with ranks that submit in different
orders and run out of data at different times ends with one set of parameters, a rank that
raises is the job's one error, and ``hvd.elastic`` resumes from its last commit after poprun's
restart. (Across hosts: tests/integration/test_multihost.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import OMP_SET, OPENMPI_LIBMPI, OPENMPI_MPIEXEC, PYTHON, ROOT, poprun, tagged_json

pytestmark = pytest.mark.slow

SCRIPTS = ROOT / "tests" / "scripts"
MIXED = str(SCRIPTS / "horovod_mixed.py")
ELASTIC = str(SCRIPTS / "horovod_elastic.py")
#: Importing torch takes seconds per process, and the machine may have two cores for three of them.
TORCH_TIMEOUT = 120
WHICH = ("import horovod, horovod.torch as hvd, horovod.torch.mpi_ops as ops, horovod.common.exceptions as ex; "
         "import popdist_py.horovod.torch as ours; hvd.init(); "
         "print(hvd is ours, ops is ours.mpi_ops, ex.HorovodInternalError is ours.HorovodInternalError, "
         "horovod.__version__, hvd.size())")


def lines_of(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line.split("] ", 1)[1]) for line in stdout.splitlines() if line.startswith("[")]


def test_horovod_imports_resolve_to_popdist_py_under_the_option() -> None:
    result = poprun("--horovod", "--num-instances", "2", PYTHON, "-c", WHICH, env=OMP_SET, timeout=TORCH_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0] True True True 0.28.1 2", "[1] True True True 0.28.1 2"]


def test_without_the_option_there_is_no_horovod() -> None:
    result = poprun("--num-instances", "1", PYTHON, "-c", "import horovod", timeout=TORCH_TIMEOUT)
    assert result.returncode == 1
    assert "ModuleNotFoundError: No module named 'horovod'" in result.stderr


def test_an_installed_horovod_is_never_hidden(tmp_path: Path) -> None:
    (tmp_path / "horovod").mkdir()
    (tmp_path / "horovod" / "__init__.py").write_text("WHOSE = 'the installed one'\n")
    result = poprun("--horovod", "--num-instances", "1", PYTHON, "-c", "import horovod; print(horovod.WHOSE)",
                    env={"PYTHONPATH": str(tmp_path)}, timeout=TORCH_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[0] the installed one\n"
    warnings = [line.split(" POPRUN [W] ", 1)[1] for line in result.stderr.splitlines() if " POPRUN [W] " in line]
    assert warnings == [(f"--horovod: Horovod is installed ({tmp_path / 'horovod'}): the program imports it, not "
                         "popdist_py's Horovod API")]


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_different_orders_and_early_joins_end_with_one_set_of_parameters(mpi: str) -> None:
    args = ["--mpi", str(OPENMPI_MPIEXEC)] if mpi == "openmpi" else []
    env = {**OMP_SET, "MPI4PY_LIBMPI": str(OPENMPI_LIBMPI)} if mpi == "openmpi" else OMP_SET
    result = poprun(*args, "--horovod", "--num-instances", "3", PYTHON, MIXED, env=env, timeout=TORCH_TIMEOUT)
    assert result.returncode == 0, result.stderr
    reports = tagged_json(result.stdout)
    assert sorted(reports) == [0, 1, 2]
    assert {r["digest"] for r in reports.values()} == {reports[0]["digest"]}
    assert {r["last_to_join"] for r in reports.values()} == {2}
    # rank r saw 4 samples from every rank not yet joined at each of its 3 + r batches
    assert [reports[r]["samples_seen"] for r in range(3)] == [36.0, 36.0 + 8.0, 36.0 + 8.0 + 4.0]


def test_a_rank_that_raises_is_the_jobs_one_error() -> None:
    result = poprun("--horovod", "--num-instances", "2", PYTHON, MIXED, "--raise-at", "1", env=OMP_SET,
                    timeout=TORCH_TIMEOUT)
    assert result.returncode == 1
    poprun_lines = [line for line in result.stderr.splitlines() if line.startswith("poprun: ")]
    failed = [line for line in poprun_lines if re.match(r"poprun: instance \d+ on \S+ failed", line)]
    assert len(failed) == 1 and failed[0].startswith("poprun: instance 1 on "), result.stderr
    assert "ValueError: rank 1 cannot read batch 1" in result.stderr
    assert "HorovodInternalError" not in result.stderr  # the others were stopped, not failed


def test_elastic_state_resumes_from_the_last_commit_after_a_restart() -> None:
    result = poprun("--horovod", "--num-instances", "2", "--max-restarts", "1", "--restart-backoff", "0", PYTHON,
                    ELASTIC, "--die-in", "2", env=OMP_SET, timeout=2 * TORCH_TIMEOUT)
    assert result.returncode == 0, result.stderr
    reports = lines_of(result.stdout)
    first = [r["committed_epoch"] for r in reports if r["start"] == 0 and r["rank"] == 0 and "committed_epoch" in r]
    second = [r["committed_epoch"] for r in reports if r["start"] == 1 and r["rank"] == 0 and "committed_epoch" in r]
    assert first[:2] == [1, 2] and second and second[0] == first[-1] + 1 and second[-1] == 4
    ends = [r for r in reports if "digest" in r]
    assert len(ends) == 2 and all(r["digest"] == r["uninterrupted"] for r in ends)


def test_the_guides_listing_initialises_horovod_beside_popdist() -> None:
    listing = str(ROOT / "examples" / "popdist_horovod.py")
    result = poprun("--horovod", "--num-instances", "2", "--num-replicas", "4", PYTHON, listing, env=OMP_SET,
                    timeout=TORCH_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [
        "[0] The number of replicas is overridden by PopRun. The new value is 4.",
        "[0] instance 0 of 2: replicas [0, 1] of 4; Horovod rank and size (0, 2)",
        "[1] The number of replicas is overridden by PopRun. The new value is 4.",
        "[1] instance 1 of 2: replicas [2, 3] of 4; Horovod rank and size (1, 2)"]
