"""Two files of the MPI suite (tests/mpi) as single tests, for `make mutants` only.

mutmut runs the tests it selects in one pytest process, and the tests of tests/mpi need several
ranks: here a file runs under a real ``mpiexec -n 2``, stopping at its first failure, so that the
mutants of agreement and of the host collectives meet those tests too. `make test` runs every file
of tests/mpi under mpiexec at 2, 3 and 4 ranks itself, so outside mutmut's copy these are skipped.
"""

from __future__ import annotations

import pytest

from tests.helpers import MPICH_MPIEXEC, PYTHON, UNDER_MUTANTS, run

pytestmark = pytest.mark.skipif(not UNDER_MUTANTS, reason="make test runs tests/mpi under mpiexec directly")


@pytest.mark.parametrize("suite", ["tests/mpi/test_world.py", "tests/mpi/test_collectives.py"])
def test_mpi_suite_passes_on_three_ranks(suite: str) -> None:
    result = run([str(MPICH_MPIEXEC), "-n", "3", PYTHON, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                  "--with-mpi", suite])  # each file takes a few seconds; a mutant that hangs it is found by the bound
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
