"""The per-instance stub: the compiled ``poprun-stub`` (``_stub.c``), and where it was not built,
the same in Python (``python -S script.py INDEX``, ``fallback``; ``program``, ``pmi_relay``).
Built-in modules, ``wire`` and ``shared`` only: its start-up time counts against every launch."""

import os

#: The Python stub's script, run as ``python -S SCRIPT INDEX``.
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "script.py")
