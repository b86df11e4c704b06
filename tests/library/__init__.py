"""popdist_py: the PopDist API, its environment contract, host collectives, the fail-safe, data sharding."""
