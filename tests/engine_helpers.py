"""Helpers shared by the engine's in-process and multi-rank tests (the ``executor`` fixture is in
tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from popdist_py.engine import ReplicaGrouping, Runtime


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


@contextmanager
def shared_dir() -> Iterator[Path]:
    """A directory made by rank 0 that every rank uses (one host: the same file system)."""
    w = world()
    d = tempfile.mkdtemp(prefix="rts-mpi-") if w.rank == 0 else None
    path = Path(w.bcast(d, root=0))
    try:
        yield path
    finally:
        w.Barrier()
        if w.rank == 0:
            for p in path.iterdir():
                p.unlink()
            path.rmdir()


def splits(replicas: int) -> list[int]:
    return [i for i in range(2, world().size + 1) if replicas % i == 0]


def wild(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 5, shape)).astype(np.float32)


def on_every_split(replicas: int, body: Any) -> None:
    """``body(rt)`` in one process, then on every split; results (lists of [L, ...] arrays) must match."""
    with Runtime(replication=replicas) as rt:
        expect = body(rt)
    for count in splits(replicas):
        with instances(count) as comm:
            if comm is None:
                continue
            with Runtime(replication=replicas, comm=comm, timeout=60) as rt:
                got = body(rt)
                off, L = rt.replica_index_offset, rt.instance_replication_factor
            assert len(got) == len(expect)
            for i, (g, e) in enumerate(zip(got, expect, strict=True)):
                e = e[off : off + L] if getattr(e, "ndim", 0) and e.shape[0] == replicas and g.shape[0] == L else e
                assert g.shape == e.shape and g.tobytes() == e.tobytes(), f"result {i}, {count} instances"
