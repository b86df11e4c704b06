"""A host's supervisor: on poprun's own host poprun itself (``instance``, ``programs``, ``stubs``),
on another host one process per job (``supervisor``, its link to poprun ``link``), started by the
first of the host's stubs."""

import os

#: A remote host's supervisor's script, run as ``python -S SCRIPT``.
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "script.py")
