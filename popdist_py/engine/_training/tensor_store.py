"""Where one training tensor lives: an engine variable, whole or sharded, on chip or off chip.

On chip a tensor is a plain or replica-sharded variable; its stored array is updated in place
(no copy per step). Off chip it is a remote variable in a file-backed remote buffer (one slot per
local replica: the whole tensor or the replica's shard). A step maps the slot's pages in
(:meth:`TensorStore.fetch`, on a read-ahead thread when marked IO: :mod:`.readahead`), works on
them in place, and then drops them from this process's resident memory (:func:`.pages.release`; the
data stays in the file and the page cache), so off-chip state costs address space, not resident
memory, and no copies.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from popdist_py.engine._placement.sharding import ShardArray, ShardLayout
from popdist_py.engine._state import pages
from popdist_py.engine._state.variables import Variable
from popdist_py.engine._training.locations import Placement


class TensorStore:
    """One tensor of a trainer: its variable and how a replica reads, works on and stores it."""

    def __init__(self, rt: Any, name: str, value: np.ndarray, placement: Placement) -> None:
        self.placement = placement
        self.off_chip = placement.off_chip
        domain = placement.domain if placement.sharded else None
        self.var: Variable
        if placement.off_chip:
            shape = (ShardLayout(value.size, domain.group_size).shard_size,) if domain is not None else value.shape
            buf = rt.remote_buffer(shape, value.dtype, entries=1, location="file")
            self.var = (rt.remote_replica_sharded_variable(value, buf, 0, shard_over=domain, name=name)
                        if domain is not None else rt.remote_variable(value, buf, 0, name=name))
        elif domain is not None:
            self.var, _ = rt.replica_sharded_variable(value, shard_over=domain, name=name)
        else:
            self.var = rt.variable(value, name=name)

    @property
    def sharded(self) -> bool:
        return self.var.sharding is not None

    def fetch(self, local_index: int) -> np.ndarray:
        """The replica's stored value itself, flat and writable (updates work in place); off chip
        its pages are mapped in first. Touches no step context: safe on a read-ahead thread."""
        value = self.var.local_value(local_index).reshape(-1)
        if self.off_chip:
            pages.prefault(value)
        return value

    def save(self, local_index: int, value: np.ndarray) -> None:
        """Store ``value`` (flat, or the variable's shape) for the replica (nothing to copy when it
        is the stored value, updated in place); off chip, drop the pages from resident memory."""
        stored = self.var.local_value(local_index)
        if not np.shares_memory(stored, value):
            np.copyto(stored, value.reshape(stored.shape))
        if self.off_chip:
            pages.release(stored)

    def shard_array(self, value: np.ndarray) -> ShardArray:
        """``value`` (this replica's shard) as a shard array that gathers back to the whole tensor."""
        assert self.var.sharding is not None
        return ShardArray.wrap(value, self.var.sharding)


__all__ = ["TensorStore"]
