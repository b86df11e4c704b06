"""What poprun's processes (the launcher, each host's supervisor and the Python stub) run: errors, paths, the network
and callback address, process sweeps, leftovers, the loopback library, torchrun's error files.
Built-in modules only."""
