"""Where replicas and their data are, as plain values (the engine's lowest level): which instance
runs which replicas (``replicas``), how replicas form groups (``grouping``), and how a tensor is
split into shards over a group (``sharding``)."""
