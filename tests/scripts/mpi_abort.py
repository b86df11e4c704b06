"""Every instance joins MPI (mpi4py), then instance ``RANK`` calls ``MPI_Abort(MPI_COMM_WORLD,
CODE)`` while the others wait in a sleep, as a job does when one rank gives up: ``mpi_abort.py
RANK CODE``. With ``raise`` as a third word that instance raises instead, and ``python -m
mpi4py`` (which runs this script) aborts for it with code 1."""

import sys
import time

from mpi4py import MPI

rank, code = int(sys.argv[1]), int(sys.argv[2])
MPI.COMM_WORLD.Barrier()
if MPI.COMM_WORLD.rank == rank:
    if sys.argv[3:] == ["raise"]:
        raise ValueError(f"rank {rank} gives up")
    MPI.COMM_WORLD.Abort(code)
time.sleep(120)
