"""popdist_py.engine in one process (each test under both executors unless marked one_executor)."""
