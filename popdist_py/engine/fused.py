"""Fused gradient reduction: the gradients of many tensors reduced in buckets, one collective each.

Consecutive tensors reduced the same way (whole, or scattered over one sharding domain) and of one
dtype are grouped into buckets of about ``limit`` bytes (Horovod's fusion buffer, DDP's buckets).
A bucket is never copied into a buffer of its own: the collective reads its tensors in place as
:class:`~popdist_py.engine._collectives.segments.Segments`, a cache-sized block at a time.

- *whole*: the flattened gradients, one after the other, are all-reduced over all replicas;
- *scatter* over domain ``D`` of ``k`` replicas: the bucket is laid out shard-major, ``[k, S]``
  where row ``j`` is the concatenation of shard ``j`` of every tensor (the balanced RTS layout of
  :class:`~popdist_py.engine.ShardLayout`, padding included), so the member ``j`` of ``D``
  receives exactly its shards of every tensor: with ``D`` all replicas one reduce-scatter; with
  ``D`` a power-of-two run of consecutive replicas (such as ``CommGroup.consecutive(L)``), a
  reduce-scatter inside ``D`` and an all-reduce of that piece across the domains (the engine's
  reduction tree over all replicas is exactly the tree inside each domain followed by the tree
  over domains, so the bits are the same, while only ``1/k`` of the bytes crosses domains);
  otherwise an all-reduce over all replicas of which each replica keeps its row.

The engine reduces elementwise with one fixed tree, so every layout gives bitwise the results of
one collective per tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from popdist_py.engine import ops
from popdist_py.engine._collectives.segments import Segments
from popdist_py.engine._placement.grouping import ReplicaGrouping
from popdist_py.engine._placement.sharding import ShardLayout


@dataclass(frozen=True)
class Bucket:
    """Gradients reduced by one collective (or, for a two-level scatter, two)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    dtype: np.dtype
    #: None: reduced whole over all replicas; else the domain whose members each receive their shards
    domain: ReplicaGrouping | None

    @property
    def layouts(self) -> tuple[ShardLayout, ...]:
        assert self.domain is not None
        return tuple(ShardLayout(n, self.domain.group_size) for n in self.sizes)


    @property
    def widths(self) -> tuple[int, ...]:
        """Each tensor's elements in this bucket's reduced result: all of them, or one shard."""
        return self.sizes if self.domain is None else tuple(lay.shard_size for lay in self.layouts)


class Fusion:
    """The buckets of a set of gradients, and where each tensor's result lies in its bucket's."""

    def __init__(self, buckets: list[Bucket]) -> None:
        self.buckets = buckets
        #: name -> (bucket, start, end) in the bucket's reduced result
        self.index: dict[str, tuple[int, int, int]] = {}
        for i, b in enumerate(buckets):
            for name, start, end in zip(b.names, [0, *itertools.accumulate(b.widths)],
                                        itertools.accumulate(b.widths), strict=False):
                self.index[name] = (i, start, end)


class Reduced(Mapping[str, np.ndarray]):
    """The reduced gradients by name, each cut from its bucket's result when asked for (cutting
    every tensor up front would cost a view per tensor and replica whether used or not)."""

    __slots__ = ("_index", "_results")

    def __init__(self, index: dict[str, tuple[int, int, int]], results: list[np.ndarray]) -> None:
        self._index = index
        self._results = results

    def __getitem__(self, name: str) -> np.ndarray:
        b, start, end = self._index[name]
        return self._results[b][start:end]

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def plan_buckets(tensors: Mapping[str, tuple[int, np.dtype, ReplicaGrouping | None]], limit: int) -> Fusion:
    """Buckets for ``tensors`` (name -> (elements, dtype, scatter domain or None), in order) of at most
    ``limit`` bytes each (a larger tensor is a bucket of its own)."""
    buckets: list[Bucket] = []
    nbytes = 0
    for name, (size, dtype, domain) in tensors.items():
        dtype = np.dtype(dtype)
        last = buckets[-1] if buckets else None
        fits = nbytes + size * dtype.itemsize <= limit
        if last is not None and (last.dtype, last.domain) == (dtype, domain) and fits:
            buckets[-1] = Bucket((*last.names, name), (*last.sizes, size), dtype, domain)
            nbytes += size * dtype.itemsize
        else:
            buckets.append(Bucket((name,), (size,), dtype, domain))
            nbytes = size * dtype.itemsize
    return Fusion(buckets)


def reduce(fusion: Fusion, grads: Mapping[str, np.ndarray], op: str, replica: int,
           everyone: ReplicaGrouping) -> Reduced:
    """Inside a step: every tensor's reduced gradient, flat: whole (read-only, shared by the local
    replicas) or, for a scattered bucket, this replica's shard (``op``: "add" or "mean").

    A bucket of several tensors goes to the collective as :class:`~popdist_py.engine._collectives.segments.Segments`:
    the gradients are read where they are, never packed into a bucket buffer first (that copy
    costs about what the reduction does)."""
    results = []
    for b in fusion.buckets:
        if b.domain is not None:
            results.append(_scatter(b, grads, op, replica, everyone))
        elif len(b.names) > 1:
            results.append(ops.replicated_all_reduce(Segments([grads[n] for n in b.names], b.dtype, b.sizes), op=op))
        else:
            results.append(ops.replicated_all_reduce(grads[b.names[0]].reshape(-1), op=op))
    return Reduced(fusion.index, results)


def _shard_major(b: Bucket, grads: Mapping[str, np.ndarray]) -> Segments:
    """The bucket laid out ``[k, S]``: row ``j`` is shard ``j`` of each tensor, zero-padded."""
    assert b.domain is not None
    flats = [grads[n].reshape(-1) for n in b.names]
    zero = np.zeros(1, b.dtype)
    pieces: list[np.ndarray] = []
    for j in range(b.domain.group_size):
        for flat, lay in zip(flats, b.layouts, strict=True):
            lo, hi = lay.bounds[j], lay.bounds[j + 1]
            pieces.append(flat[lo:hi])
            if hi - lo < lay.shard_size:  # the one padding element of this shard
                pieces.append(zero)
    return Segments(pieces, b.dtype, [p.size for p in pieces])


def _scatter(b: Bucket, grads: Mapping[str, np.ndarray], op: str, replica: int,
             everyone: ReplicaGrouping) -> np.ndarray:
    domain = b.domain
    assert domain is not None
    k = domain.group_size
    width = sum(b.widths)
    flat = _shard_major(b, grads)
    if domain == everyone:
        return ops.replicated_reduce_scatter(flat, op=op, group=domain)
    if k & (k - 1) == 0 and domain.stride == 1:  # inside the domain, then across the domains: the same tree
        piece = ops.replicated_reduce_scatter(flat, op="add", group=domain)
        total = ops.replicated_all_reduce(piece, op="add", group=domain.transpose())
        if op == "mean":  # divided once by the replica count, as a mean over all replicas is
            mean: np.ndarray = np.divide(total, b.dtype.type(everyone.group_size))
            return mean
        return total
    j = domain.index_in_group(replica)
    return ops.replicated_all_reduce(flat, op=op)[j * width:(j + 1) * width]


__all__ = ["Bucket", "Fusion", "Reduced", "plan_buckets", "reduce"]
