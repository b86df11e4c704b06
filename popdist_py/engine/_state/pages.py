"""The pages of a shared mapping (a memory-mapped file, shared memory) in this process's resident set.

Off-chip training state (:mod:`popdist_py.engine._training.tensor_store`) and a pipeline's stash of
activations (:mod:`popdist_py.engine.pipeline.stash`) live in such mappings: a thread maps a
tensor's pages in before it is worked on (:func:`prefault`) and drops them after
(:func:`release`), so the state costs address space, not resident memory.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Any

import numpy as np

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


__all__ = ["prefault", "release"]
