"""Where one training tensor lives: an engine variable, whole or sharded, on chip or off chip.

On chip a tensor is a plain or replica-sharded variable; its stored array is updated in place
(no copy per step). Off chip it is a remote variable in a file-backed remote buffer (one slot per
local replica: the whole tensor or the replica's shard). A step maps the slot's pages in
(:meth:`TensorStore.fetch`, on a read-ahead thread when marked IO: :mod:`.readahead`), works on
them in place, and then drops them from this process's resident memory (:func:`release`; the
data stays in the file and the page cache), so off-chip state costs address space, not resident
memory, and no copies.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Any

import numpy as np

from popdist_py.engine._state.sharding import ShardArray, ShardLayout
from popdist_py.engine._state.variables import Variable
from popdist_py.engine._training.locations import Placement

_MADV_DONTNEED = 4  # Linux's madvise advice values
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_libc: Any = None


def _mapped(view: np.ndarray) -> bool:
    """Whether ``view`` lies in a shared mapping: a memory-mapped file, or an ``mmap.mmap``."""
    if isinstance(view, np.memmap):
        return True
    base: Any = view
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return isinstance(base, mmap.mmap) or (isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap))


def _madvise(view: np.ndarray, advice: int) -> bool:
    """madvise over the pages of ``view``, which lies in a shared mapping (:func:`_mapped`); False
    when not applicable or refused."""
    global _libc
    if view.nbytes == 0 or not sys.platform.startswith("linux") or not _mapped(view):
        return False
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    address = view.__array_interface__["data"][0]
    start = address - address % mmap.PAGESIZE
    done: bool = _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + view.nbytes - start), advice) == 0
    return done


def release(view: np.ndarray) -> None:
    """Drop the pages of ``view``, in a shared mapping, from this process's resident set (the data
    stays in the file or shared memory and is faulted back in when next used)."""
    _madvise(view, _MADV_DONTNEED)


def prefault(view: np.ndarray) -> None:
    """Map the pages of ``view``, in a shared mapping, in, writable, now (so the thread that does this
    takes the page faults, not the one that computes next); older kernels: touch every page."""
    if view.nbytes and _mapped(view) and not _madvise(view, _MADV_POPULATE_WRITE):
        view.reshape(-1).view(np.uint8)[:: mmap.PAGESIZE].max()


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
            prefault(value)
        return value

    def save(self, local_index: int, value: np.ndarray) -> None:
        """Store ``value`` (flat, or the variable's shape) for the replica (nothing to copy when it
        is the stored value, updated in place); off chip, drop the pages from resident memory."""
        stored = self.var.local_value(local_index)
        if not np.shares_memory(stored, value):
            np.copyto(stored, value.reshape(stored.shape))
        if self.off_chip:
            release(stored)

    def shard_array(self, value: np.ndarray) -> ShardArray:
        """``value`` (this replica's shard) as a shard array that gathers back to the whole tensor."""
        assert self.var.sharding is not None
        return ShardArray.wrap(value, self.var.sharding)


__all__ = ["TensorStore", "prefault", "release"]
