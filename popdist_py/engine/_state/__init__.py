"""What a runtime holds between steps: variables (``variables``), replicated tensor sharding
(``sharding``), remote buffers in memory or files (``remote``), and checkpoints under any split
(``checkpoint``)."""
