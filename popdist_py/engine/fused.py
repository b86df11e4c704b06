"""Fused gradient reduction: the gradients of many tensors reduced in buckets, one collective each.

Consecutive tensors reduced the same way (whole, or scattered over one sharding domain) and of one
dtype are packed into buckets of about ``limit`` bytes (Horovod's fusion buffer, DDP's buckets):

- *whole*: the flattened gradients are concatenated and all-reduced over all replicas;
- *scatter* over domain ``D`` of ``k`` replicas: the bucket is laid out shard-major, ``[k, S]``
  where row ``j`` is the concatenation of shard ``j`` of every tensor (the balanced RTS layout of
  :class:`~popdist_py.engine.sharding.ShardLayout`, padding included), so the member ``j`` of ``D``
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

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from popdist_py.engine import ops
from popdist_py.engine.grouping import ReplicaGrouping
from popdist_py.engine.sharding import ShardLayout


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


def plan(tensors: Mapping[str, tuple[int, np.dtype, ReplicaGrouping | None]], limit: int) -> list[Bucket]:
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
    return buckets


class Scratch:
    """One reusable packing buffer per local replica and dtype: a bucket is packed into it and
    reduced, and the collective's result is a new array, so the next bucket (and step) may reuse
    it. Packing into warm memory instead of a new allocation saves the page faults of a fresh
    buffer, which cost more than the copy itself."""

    def __init__(self, num_local_replicas: int) -> None:
        self._buffers: list[dict[np.dtype, np.ndarray]] = [{} for _ in range(num_local_replicas)]

    def get(self, local_index: int, size: int, dtype: np.dtype) -> np.ndarray:
        """``size`` elements of ``dtype`` (contents undefined), this replica's alone."""
        mine = self._buffers[local_index]
        buf = mine.get(dtype)
        if buf is None or buf.size < size:
            mine[dtype] = buf = np.empty(size, dtype)
        return buf[:size]


def reduce(buckets: list[Bucket], grads: Mapping[str, np.ndarray], op: str, replica: int,
           everyone: ReplicaGrouping, scratch: Callable[[int, np.dtype], np.ndarray] | None = None,
           ) -> dict[str, np.ndarray]:
    """Inside a step: every tensor's reduced gradient, flat: whole (read-only, shared by the local
    replicas) or, for a scattered bucket, this replica's shard (``op``: "add" or "mean").
    ``scratch(size, dtype)``: a reusable buffer to pack buckets into (default: a new one each)."""
    out: dict[str, np.ndarray] = {}
    for b in buckets:
        if b.domain is None:
            if len(b.names) > 1:
                flat = _buffer(scratch, sum(b.sizes), b.dtype)
                np.concatenate([grads[n].reshape(-1) for n in b.names], out=flat)
            else:
                flat = grads[b.names[0]].reshape(-1)
            reduced = _detached(ops.replicated_all_reduce(flat, op=op), flat)
            offset = 0
            for n, size in zip(b.names, b.sizes, strict=True):
                out[n] = reduced[offset:offset + size]
                offset += size
            continue
        mine = _scatter(b, grads, op, replica, everyone, scratch)
        offset = 0
        for n, layout in zip(b.names, b.layouts, strict=True):
            out[n] = mine[offset:offset + layout.shard_size]
            offset += layout.shard_size
    return out


def _buffer(scratch: Callable[[int, np.dtype], np.ndarray] | None, size: int, dtype: np.dtype) -> np.ndarray:
    return scratch(size, dtype) if scratch is not None else np.empty(size, dtype)


def _detached(result: np.ndarray, packed: np.ndarray) -> np.ndarray:
    """``result``, copied if it shares memory with the reusable ``packed`` buffer (it never does with
    the engine's collectives today: this keeps a later bucket from overwriting it if one ever did)."""
    return result.copy() if np.shares_memory(result, packed) else result


def _scatter(b: Bucket, grads: Mapping[str, np.ndarray], op: str, replica: int,
             everyone: ReplicaGrouping, scratch: Callable[[int, np.dtype], np.ndarray] | None) -> np.ndarray:
    domain = b.domain
    assert domain is not None
    k = domain.group_size
    layouts = b.layouts
    width = sum(lay.shard_size for lay in layouts)
    rows = _buffer(scratch, k * width, b.dtype).reshape(k, width)  # shard-major: row j: shard j of each tensor
    offset = 0
    for n, lay in zip(b.names, layouts, strict=True):
        rows[:, offset:offset + lay.shard_size] = lay.split(grads[n].reshape(-1))
        offset += lay.shard_size
    flat = rows.reshape(-1)
    if domain == everyone:
        return _detached(ops.replicated_reduce_scatter(flat, op=op, group=domain), flat)
    if k & (k - 1) == 0 and domain.stride == 1:  # inside the domain, then across the domains: the same tree
        piece = _detached(ops.replicated_reduce_scatter(flat, op="add", group=domain), flat)
        total = ops.replicated_all_reduce(piece, op="add", group=domain.transpose())
        if op == "mean":  # divided once by the replica count, as a mean over all replicas is
            return np.divide(total, b.dtype.type(everyone.group_size))
        return total
    j = domain.index_in_group(replica)
    return _detached(ops.replicated_all_reduce(flat, op=op), flat)[j * width:(j + 1) * width]


__all__ = ["Bucket", "Scratch", "plan", "reduce"]
