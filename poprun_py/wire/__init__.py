"""The control channel between poprun and its shims: sockets, sealed frames, their messages.
Both processes import it: built-in modules only."""
