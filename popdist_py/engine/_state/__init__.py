"""What a runtime holds between steps: variables (``variables``), remote buffers in memory or files
(``remote``), checkpoints under any split (``checkpoint``), and the resident pages of mapped
state (``pages``)."""
