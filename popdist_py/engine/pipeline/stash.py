"""What a stage keeps for its backward while a micro-batch is in flight (the stash), on or off chip.

PopART's activation tensor location settings decide where stashed activations live. On chip
the stash is a dict of the values the forward returned. Off chip, every array of at least
``min_elements`` elements in a stashed value (nested in tuples, lists or dicts) is copied into
shared memory (an anonymous shared mapping: host RAM outside the process's resident set once
its pages are dropped) and read back, in place, for the backward. A device reuses its mappings:
with 1F1B it holds at most ``K - s`` of them.

Values read back are valid during the backward that pops them: the next forward on the device
may reuse their memory.
"""

from __future__ import annotations

import mmap
from typing import Any, NamedTuple

import numpy as np

from popdist_py.engine._state.pages import prefault, release

_ALIGN = 64


class _Slot(NamedTuple):
    """Where a spilled array lies in its entry's mapping."""

    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]


class _Entry(NamedTuple):
    memory: mmap.mmap
    #: the stashed value with each spilled array replaced by its :class:`_Index`
    template: Any
    slots: list[_Slot]


class Stash:
    """One device's stash (see the module docstring)."""

    def __init__(self, off_chip: bool = False, min_elements: int = 0) -> None:
        self.off_chip = off_chip
        self.min_elements = min_elements
        self._values: dict[int, Any] = {}
        self._entries: dict[int, _Entry] = {}
        self._free: list[mmap.mmap] = []

    def __len__(self) -> int:
        return len(self._values) + len(self._entries)

    def put(self, micro_batch: int, value: Any) -> None:
        if not self.off_chip:
            self._values[micro_batch] = value
            return
        arrays: list[np.ndarray] = []

        def spill(a: np.ndarray) -> Any:
            if a.size < max(1, self.min_elements) or a.dtype.hasobject:
                return a
            arrays.append(a)
            return _Index(len(arrays) - 1)

        template = _map(value, np.ndarray, spill)
        if not arrays:
            self._values[micro_batch] = value
            return
        slots, size = [], 0
        for a in arrays:
            size = -(-size // _ALIGN) * _ALIGN
            slots.append(_Slot(size, a.dtype, a.shape))
            size += a.nbytes
        memory = self._mapping(size)
        for a, slot in zip(arrays, slots, strict=True):
            view = _view(memory, slot)
            np.copyto(view, a)
            release(view)
        self._entries[micro_batch] = _Entry(memory, template, slots)

    def pop(self, micro_batch: int) -> Any:
        if micro_batch in self._values:
            return self._values.pop(micro_batch)
        entry = self._entries.pop(micro_batch)

        def page_in(k: _Index) -> np.ndarray:
            view = _view(entry.memory, entry.slots[k])
            prefault(view)
            return view

        self._free.append(entry.memory)  # reused by a later forward (after this backward)
        return _map(entry.template, _Index, page_in)

    def clear(self) -> None:
        """Forget every stashed value (a step that failed leaves some); the mappings are kept."""
        self._values.clear()
        self._free += [e.memory for e in self._entries.values()]
        self._entries.clear()

    def spilled_bytes(self) -> int:
        """Bytes of the shared mappings this stash holds (in use or free)."""
        return sum(len(e.memory) for e in self._entries.values()) + sum(len(m) for m in self._free)

    def _mapping(self, size: int) -> mmap.mmap:
        """A free shared mapping of at least ``size`` bytes (the smallest that fits), or a new one."""
        fits = [m for m in self._free if len(m) >= size]
        if fits:
            memory = min(fits, key=len)
            self._free.remove(memory)
            return memory
        return mmap.mmap(-1, max(mmap.PAGESIZE, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE))


class _Index(int):
    """A placeholder for the k-th spilled array of a stashed value."""


def _view(memory: mmap.mmap, slot: _Slot) -> np.ndarray:
    count = int(np.prod(slot.shape, dtype=np.int64))
    return np.frombuffer(memory, slot.dtype, count, slot.offset).reshape(slot.shape)


def _map(value: Any, leaf: type, fn: Any) -> Any:
    """``value`` with every ``leaf`` instance in it (through tuples, NamedTuples, lists and dicts)
    replaced by ``fn(leaf)``."""
    if isinstance(value, leaf):
        return fn(value)
    if isinstance(value, tuple):
        items = [_map(v, leaf, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_map(v, leaf, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map(v, leaf, fn) for k, v in value.items()}
    return value


__all__ = ["Stash"]
