"""The contract between poprun (the launcher) and popdist_py (the library): every environment
variable either sets or reads, defined once (``environment``), and the one reader of settings
(``settings``). Standard library only, and nothing of either package: the Python stub and the hosts'
supervisors import it under ``python -S``, and the library runs without the launcher (bare mpiexec, srun)."""

#: The distribution's one version: pyproject.toml reads it; poprun_py.__version__ and
#: popdist_py.__version__ are this one, so neither package needs the other for it.
__version__ = "0.1.0"
