"""The script ``mpiexec`` starts for each instance: ``python -S poprun_py/instance/script.py INDEX``
(the program comes from poprun: see ``shim``).

Kept to these lines because a script is compiled on every run, while the shim's modules are
imported from their cached bytecode.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from poprun_py.instance.shim import main
from poprun_py.stub.program import leave

# os._exit (in leave): the shim writes through raw descriptors only, so the interpreter's
# teardown (~2 ms) has nothing to flush.
leave(main())
