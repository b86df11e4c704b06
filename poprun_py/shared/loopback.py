"""Hydra's and Open MPI's launchers kept on loopback in a one-host job.

Hydra's ``mpiexec`` and Open MPI's ``prterun`` listen for their proxies and daemons on every
interface (they bind the wildcard address whatever their settings say), though a one-host job
starts no remote one. ``_loopback.c``, a small library built with the package, turns such a bind
into one to loopback in a process that preloads it. poprun preloads it into the launcher of a
one-host Hydra or Open MPI job (``LD_PRELOAD``, ahead of the user's own; ``mpi.loopback_library``),
and each host's supervisor takes it out again before the program starts: what the program itself listens on is
its own business.

Built-in modules only: each host's supervisor uses it.
"""

from __future__ import annotations

import os

from popcontract import compiled

HERE = os.path.dirname(os.path.abspath(__file__))
#: The library's name in the package: built like an extension module, but preloaded into another
#: program, never imported (it has no Python module in it).
NAME = compiled.LOOPBACK.rpartition(".")[2]


def library() -> str | None:
    """The built library's path; None where it was not built (the build needs a C compiler,
    and a platform with ``LD_PRELOAD``)."""
    return compiled.library(compiled.LOOPBACK)


def preloaded(value: str | None, path: str) -> str:
    """``LD_PRELOAD``'s ``value`` with ``path`` first (once: a restart builds the command again)."""
    entries = [entry for entry in _entries(value) if entry != path]
    return " ".join([path, *entries])


def without_library(value: str) -> str:
    """``LD_PRELOAD``'s ``value`` without this package's library, in whatever order the rest came."""
    return " ".join(entry for entry in _entries(value) if not _ours(entry))


def _entries(value: str | None) -> list[str]:
    # ld.so separates LD_PRELOAD's entries by spaces or colons.
    return (value or "").replace(":", " ").split()


def _ours(entry: str) -> bool:
    directory, name = os.path.split(entry)
    return directory == HERE and name.startswith(NAME + ".")
