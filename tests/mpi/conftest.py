"""Guards for multi-rank runs (``mpiexec -n N python -m pytest --with-mpi tests/mpi``).

A launcher/library mismatch would silently run N singletons; one basetemp per rank avoids the
ranks racing on pytest's shared temp root.
"""

import os
import tempfile

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if not (config.getoption("--with-mpi") or config.getoption("--only-mpi")):
        return
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    launched = os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE")
    if launched and int(launched) != comm.size:
        pytest.exit(
            f"mpiexec started {launched} ranks but COMM_WORLD.size={comm.size}: "
            "mpiexec and mpi4py's libmpi do not match",
            returncode=3,
        )
    if comm.size > 1 and config.option.basetemp is None:
        root = tempfile.mkdtemp(prefix="pytest-mpi-") if comm.rank == 0 else None
        config.option.basetemp = os.path.join(comm.bcast(root, root=0), f"rank{comm.rank}")
