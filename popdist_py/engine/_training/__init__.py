"""The Trainer (``training``): tensor location settings (``locations``), off-chip storage
(``tensor_store``) and its read-ahead (``readahead``)."""
