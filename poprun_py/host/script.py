"""A remote host's supervisor's entry: ``python -S poprun_py/host/script.py`` (see ``supervisor``),
started by the first stub of the job on the host.

Kept to these lines because a script is compiled on every run, while the modules are imported
from their cached bytecode.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from poprun_py.host.supervisor import main

# os._exit: the supervisor writes through raw descriptors only, so the interpreter's teardown has
# nothing to flush.
os._exit(main())
