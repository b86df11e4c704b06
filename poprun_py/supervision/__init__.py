"""A job while it runs, in poprun's process: mpiexec started, the shims' connections and output
watched, the first failure found and explained, every instance stopped, restarts."""
