"""Horovod's process sets: collectives over a subset of the ranks.

The global set (id 0, every rank) always exists. Others are given to ``init(process_sets=...)``
or added later with :func:`add_process_set` (collective over every rank: each calls it with the
same ranks) and removed with :func:`remove_process_set`. A set is known by its id once
registered; ops take it as ``process_set=``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."
#: This process's rank in the world of the running ``init`` (None before it and after shutdown).
_world_rank: int | None = None


def set_world_rank(rank: int | None) -> None:
    """Called by ``init`` and ``shutdown``: the rank sets' ``rank()`` and ``included()`` answer for."""
    global _world_rank
    _world_rank = rank


def world_rank() -> int:
    if _world_rank is None:
        raise ValueError(NOT_INITIALIZED)
    return _world_rank


class ProcessSet:
    """A set of ranks (or an mpi4py communicator whose ranks they are) that ops can run over."""

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        self.process_set_id: int | None = None
        self.mpi_comm: Any = None
        if hasattr(ranks_or_comm, "Get_group"):
            self.mpi_comm = ranks_or_comm
            self.ranks: list[int] = []
        else:
            ranks = list(ranks_or_comm)
            if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
                raise ValueError(f"ProcessSet({ranks!r}): ranks must be integers")
            self.ranks = sorted(ranks)

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> int | None:
        """Its number of ranks, or None before it is registered."""
        if self.process_set_id is None:
            return None
        return len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set, or None before it is registered; ValueError when
        this process is not in it."""
        if self.process_set_id is None:
            return None
        me = world_rank()
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not in {self}")
        return self.ranks.index(me)

    def included(self) -> bool | None:
        """Whether this process is in the set, or None before it has ranks."""
        if self.ranks is None:
            return None
        return world_rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


#: Every rank of the job; its id is 0.
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
