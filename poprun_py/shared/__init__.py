"""What both of poprun's processes (the launcher and every shim) run: errors, paths, the network
and callback address, process sweeps, leftovers, the loopback library, torchrun's error files.
Built-in modules only."""
