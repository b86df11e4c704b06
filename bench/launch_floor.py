"""The least a launcher shaped like poprun can add to bare mpiexec, as a command to time beside it.

``python launch_floor.py [--click] N PROGRAM [ARGS...]``: this interpreter (with ``site``, as
poprun's console script has it), with ``--click`` also the import of click (poprun's one command-line
parser), then ``mpiexec.gforker -n N`` (what poprun starts a one-host job with) starting each
instance as ``python -S`` that execs PROGRAM (the interpreter a Python shim per instance costs).
No plan, no control channel, no output pump, no supervision, no end to wait for: whatever poprun
takes beyond this is its own work.

Run as a file, not as ``-m bench...``, so that nothing but what is named above is imported.
"""

import os
import sys

if sys.argv[1] == "--click":
    import click  # noqa: F401  (its import is what is measured)

    del sys.argv[1]
count, program = sys.argv[1], sys.argv[2:]
folder = os.path.dirname(sys.executable)
hop = "import os, sys; os.execvp(sys.argv[1], sys.argv[1:])"
gforker = os.path.join(folder, "mpiexec.gforker")
os.execv(gforker, [gforker, "-n", count, sys.executable, "-S", "-c", hop, *program])
