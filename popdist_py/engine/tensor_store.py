"""Where one training tensor lives: an engine variable, whole or sharded, on chip or off chip.

On chip a tensor is a plain or replica-sharded variable; its stored array is updated in place
(no copy per step). Off chip it is a remote variable in a file-backed remote buffer (one slot per
local replica: the whole tensor or the replica's shard); a step works on a private copy loaded
from the slot (ahead of time with read-ahead, :mod:`.readahead`) and stores it back, after which
the slot's pages are dropped from this process's resident memory (the data stays in the file and
the page cache), so off-chip state costs address space, not resident memory.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Any

import numpy as np

from popdist_py.engine.locations import Placement
from popdist_py.engine.sharding import ShardArray, ShardLayout
from popdist_py.engine.variables import Variable

_MADV_DONTNEED = 4  # Linux
_libc: Any = None


def release(view: np.ndarray) -> None:
    """Drop the pages of a memory-mapped ``view`` from this process's resident set (Linux; the
    mapping is shared, so the data stays in the file and is faulted back in when next read)."""
    global _libc
    if not isinstance(view, np.memmap) or view.nbytes == 0 or not sys.platform.startswith("linux"):
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    address = view.__array_interface__["data"][0]
    start = address - address % mmap.PAGESIZE
    _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + view.nbytes - start), _MADV_DONTNEED)


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

    def load(self, local_index: int) -> np.ndarray:
        """A private, flat, writable copy of the replica's stored value (safe on any thread)."""
        stored = self.var.local_value(local_index)
        value = np.array(stored, copy=True).reshape(-1)
        release(stored)
        return value

    def working(self, local_index: int) -> np.ndarray:
        """What an update changes, flat: on chip the stored array itself, off chip a loaded copy."""
        if self.off_chip:
            return self.load(local_index)
        return self.var.local_value(local_index).reshape(-1)

    def save(self, local_index: int, value: np.ndarray) -> None:
        """Store ``value`` (flat, or the variable's shape) for the replica: nothing to do when it is
        the stored array, updated in place."""
        stored = self.var.local_value(local_index)
        if not self.off_chip and np.shares_memory(stored, value):
            return
        np.copyto(stored, value.reshape(stored.shape))
        release(stored)

    def shard_array(self, value: np.ndarray) -> ShardArray:
        """``value`` (this replica's shard) as a shard array that gathers back to the whole tensor."""
        assert self.var.sharding is not None
        return ShardArray.wrap(value, self.var.sharding)


__all__ = ["TensorStore", "release"]
