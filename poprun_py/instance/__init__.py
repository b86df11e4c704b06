"""The instance side: the shim that mpiexec starts once per instance (``python -S script.py``),
which starts the program. Imports built-in modules, ``wire`` and ``shared`` only: its start-up time
counts against every launch."""

import os

#: The script mpiexec starts for each instance, with the instance's index as its one argument.
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "script.py")
