"""The control channel between poprun and the hosts' supervisors (sockets, sealed frames, their
messages), and the stubs' frames to their supervisor. Every process of a job imports it: built-in
modules only."""
