"""Helpers shared by the engine's in-process and multi-rank tests (the ``executor`` fixture is in
tests/conftest.py)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from popdist_py.engine import ReplicaGrouping


def valid_groupings(n: int) -> list[ReplicaGrouping]:
    """Every distinct valid (stride, group_size) grouping of n replicas."""
    out: list[ReplicaGrouping] = []
    for s in range(1, n + 1):
        for g in range(1, n + 1):
            if n % s == 0 and n % (s * g) == 0:
                rg = ReplicaGrouping.create(n, s, g)
                if rg not in out:
                    out.append(rg)
    return out


def load_script(path: Path) -> Any:
    """Import a test script (tests/scripts/*.py) as a module, to call its functions in-process."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def world() -> Any:
    from mpi4py import MPI

    return MPI.COMM_WORLD


@contextmanager
def instances(count: int) -> Iterator[Any]:
    """A communicator of ranks 0..count-1 (None on the other ranks); collective over COMM_WORLD."""
    from mpi4py import MPI

    w = world()
    comm = w.Split(0 if w.rank < count else MPI.UNDEFINED, w.rank)
    try:
        yield None if comm == MPI.COMM_NULL else comm
    finally:
        if comm != MPI.COMM_NULL:
            comm.Free()
        w.Barrier()
