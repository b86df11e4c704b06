"""The command line, in poprun's process before anything starts: click's options, config files,
one-line usage errors; ``main`` is the ``poprun`` entry point."""
