"""A job while it runs, in poprun's process: mpiexec started, its host's stubs and the other
hosts' supervisors' connections and the output watched, the first failure found and explained,
every instance stopped, restarts."""
