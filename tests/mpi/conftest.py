"""Guards for multi-rank runs (``mpiexec -n N python -m pytest --with-mpi tests/mpi``).

A launcher/library mismatch would silently run N singletons; one basetemp per rank avoids the
ranks racing on pytest's shared temp root.
"""

import os
import shutil
import tempfile

import pytest

_ROOT = pytest.StashKey[str]()


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
        config.stash[_ROOT] = comm.bcast(root, root=0)
        config.option.basetemp = os.path.join(config.stash[_ROOT], f"rank{comm.rank}")


def pytest_unconfigure(config: pytest.Config) -> None:
    """The ranks' shared temp root goes when every rank is done with it."""
    root = config.stash.get(_ROOT, None)
    if root is None:
        return
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
