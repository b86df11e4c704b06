"""Instance 0 leaves with os._exit(0) (no MPI_Finalize) while instance 1 waits in a collective."""

import os

import numpy as np

import popdist_py

popdist_py.init()
if popdist_py.getInstanceIndex() == 0:
    os._exit(0)
popdist_py.allreduce(np.ones(2))
