"""Every instance initialises MPI (MPICH creates its shared-memory segments); then instance 1
exits 3 and the others wait until poprun stops them."""

import sys
import time

import popdist_py

popdist_py.init()
popdist_py.barrier()
if popdist_py.getInstanceIndex() == 1:
    sys.exit(3)
time.sleep(120)
