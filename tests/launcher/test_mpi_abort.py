"""A rank that calls MPI_Abort is named as the instance that failed, with its abort code as
poprun's status, whichever rank it is and whichever MPI launcher runs the job; the others, which
the abort takes down, are stopped, not failures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import BIN, OMP_SET, OPENMPI_LIBMPI, OPENMPI_MPIEXEC, PYTHON, ROOT, poprun

pytestmark = pytest.mark.slow
SCRIPT = str(ROOT / "tests" / "scripts" / "mpi_abort.py")
INSTANCES = 3
#: How poprun is told to use each launcher (gforker: its own choice for one host), and what the
#: instances need for it.
LAUNCHERS = {"gforker": ([], OMP_SET), "hydra": (["--mpi", str(BIN / "mpiexec")], OMP_SET),
             "openmpi": (["--mpi", str(OPENMPI_MPIEXEC)], {**OMP_SET, "MPI4PY_LIBMPI": str(OPENMPI_LIBMPI)})}


def check(result_stderr: str, returncode: int, error_file: Path, rank: int, status: int, how: str) -> None:
    """``rank`` is the instance that failed, first, alone, with ``status``; the others were stopped."""
    lines = [line for line in result_stderr.splitlines() if line.startswith("poprun: ")]
    assert returncode == status, result_stderr
    assert re.fullmatch(rf"poprun: instance {rank} on \S+ failed: {re.escape(how)}", lines[0]), result_stderr
    assert " also failed" not in result_stderr and "lost" not in result_stderr, result_stderr
    report = json.loads(error_file.read_text())[-1]
    assert (report["instance"], report["status"]) == (rank, status), report
    assert [failure["instance"] for failure in report["failures"]] == [rank], report
    others = [i for i in range(INSTANCES) if i != rank]
    assert set(report["stopped"]) <= set(others), report


@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize("mpi", ["gforker", "hydra"])
def test_the_rank_that_calls_mpi_abort_is_named_with_its_code(mpi: str, rank: int, tmp_path: Path) -> None:
    args, env = LAUNCHERS[mpi]
    error_file = tmp_path / "error.json"
    result = poprun(*args, "--error-file", str(error_file), "--num-instances", str(INSTANCES), PYTHON, SCRIPT,
                    str(rank), "5", env=env)
    check(result.stderr, result.returncode, error_file, rank, 5, "called MPI_Abort (exit status 5)")
    # MPICH's own line, from the program, is among its last lines
    assert f"Abort(5) on node {rank} (rank {rank} in comm 0): application called MPI_Abort" in result.stderr
    # poprun stopped every other instance (the launcher never saw the abort)
    report = json.loads(error_file.read_text())[-1]
    assert report["stopped"] == [i for i in range(INSTANCES) if i != rank], report


@pytest.mark.parametrize("rank", [0, 2])
def test_mpi_abort_under_open_mpi_names_the_rank(rank: int, tmp_path: Path) -> None:
    """Open MPI's MPI_Abort ends the program with its code by itself, before prterun ends the others."""
    args, env = LAUNCHERS["openmpi"]
    error_file = tmp_path / "error.json"
    result = poprun(*args, "--error-file", str(error_file), "--num-instances", str(INSTANCES), PYTHON, SCRIPT,
                    str(rank), "5", env=env)
    check(result.stderr, result.returncode, error_file, rank, 5, "exit status 5")


@pytest.mark.parametrize("mpi", ["gforker", "hydra"])
def test_an_uncaught_exception_under_python_m_mpi4py_names_its_rank(mpi: str, tmp_path: Path) -> None:
    """``python -m mpi4py`` calls MPI_Abort with code 1 on an uncaught exception."""
    args, env = LAUNCHERS[mpi]
    error_file = tmp_path / "error.json"
    result = poprun(*args, "--error-file", str(error_file), "--num-instances", str(INSTANCES), PYTHON, "-m",
                    "mpi4py", SCRIPT, "1", "0", "raise", env=env)
    check(result.stderr, result.returncode, error_file, 1, 1, "called MPI_Abort (exit status 1)")
    assert "    ValueError: rank 1 gives up" in result.stderr.splitlines()


@pytest.mark.parametrize("code,status", [(0, 1), (300, 44)])
def test_an_abort_code_becomes_the_status_mpiexec_would_give(code: int, status: int, tmp_path: Path) -> None:
    """Its low byte, as mpiexec's; 1 for a code whose low byte is 0: the job did not finish."""
    error_file = tmp_path / "error.json"
    result = poprun("--error-file", str(error_file), "--num-instances", "2", PYTHON, SCRIPT, "1", str(code),
                    env=OMP_SET)
    lines = [line for line in result.stderr.splitlines() if line.startswith("poprun: ")]
    assert result.returncode == status, result.stderr
    assert re.fullmatch(rf"poprun: instance 1 on \S+ failed: called MPI_Abort \(exit status {status}\)", lines[0])
