"""How the L local replicas of a step run: which replicas this instance holds (``replicas``),
the replica a step runs as (``context``), and the executors (``executor`` chooses; ``pool``:
threads, ``cooperative``: greenlets)."""
