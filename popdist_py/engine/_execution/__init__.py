"""How the L local replicas' work runs: the executors (``executor`` chooses; ``pool``: threads,
``cooperative``: greenlets), their share of the BLAS threads (``blas``), and a large collective's
local work in slices on several threads (``slices``)."""
