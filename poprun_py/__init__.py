"""poprun: launch data-parallel Python jobs on MPI, the way Graphcore's PopRun does.

Kept import-free on purpose: the per-instance shim imports this package with ``python -S``
and ``poprun``'s start-up time counts against every launch.
"""

#: The distribution's one version: pyproject.toml reads it, popdist_py.__version__ is this one.
__version__ = "0.1.0"
