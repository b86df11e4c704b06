"""Replicated tensor sharding (RTS): the balanced shard layout, sharding domains and shard arrays.

Layout. A tensor of ``n`` elements sharded over ``k`` replicas is flattened (C order) and cut
into ``k`` shards of ``s = ceil(n / k)`` elements. The ``p = k * s - n`` padding elements
(always fewer than ``k``) are spread one per shard over the *last* ``p`` shards, each at the end
of its shard, so shard ``j`` holds ``s`` real elements when ``j < k - p`` and ``s - 1`` real
elements plus one zero otherwise, starting at flat element ``j * s - max(0, j - (k - p))``.
30 elements over 4 replicas: shards ``[0:8]``, ``[8:16]``, ``[16:23]+0``, ``[23:30]+0`` (the
seed's "two replicas with 8 elements, two with 7 and one pad"). Downloads drop the pads again.

Domains. A variable with replica grouping ``rg`` (stride ``t``, group size ``G``) sharded over
``shard_over = k`` (a divisor of ``G``; default ``G``) has its value repeat every ``k``
consecutive group members, and member ``m`` of a group holds shard ``m % k`` (PopXL's rule).
The ``k`` consecutive members that together hold one full copy form the sharding *domain*, the
grouping ``(stride=t, group_size=k)`` (for an irregular grouping, the runs of ``k`` consecutive
members of its groups: ``ReplicaGrouping.split``): it is the group every gather, reduce-scatter and slice of
that variable uses, and a replica's shard index is its index in its domain group.
``CommGroup.consecutive(L)`` (PopART's per-instance domain) is ``shard_over=L`` on an ungrouped
variable; sharding over all replicas of several instances is the default.

Shard arrays. Inside a step a shard travels as a :class:`ShardArray`, an ndarray subclass that
carries its :class:`ShardMeta` (full shape and domain), so ``ops.replicated_all_gather`` can
turn it back into the full, un-padded tensor. Elementwise arithmetic keeps the meta; anything
that changes the shape drops it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from popdist_py import validate
from popdist_py.engine._placement.grouping import CommGroup, ReplicaGrouping


@dataclass(frozen=True)
class ShardLayout:
    """The balanced layout of ``n`` flat elements over ``count`` shards (see the module docstring)."""

    n: int
    count: int

    def __post_init__(self) -> None:
        validate.non_negative("shard layout: n", self.n)
        validate.count("shard layout: count", self.count)

    @property
    def shard_size(self) -> int:
        """Elements per shard, padding included: ``ceil(n / count)``."""
        return -(-self.n // self.count)

    @property
    def padding(self) -> int:
        """Zero elements added in all (one in each of the last ``padding`` shards)."""
        return self.count * self.shard_size - self.n

    @property
    def full_shards(self) -> int:
        """Shards without padding (the first ones)."""
        return self.count - self.padding

    def start(self, j: int) -> int:
        """Flat index of shard ``j``'s first real element (``start(count) == n``)."""
        return j * self.shard_size - max(0, j - self.full_shards)

    def real(self, j: int) -> int:
        """Real (non-padding) elements of shard ``j``."""
        return self.start(j + 1) - self.start(j)

    @cached_property
    def bounds(self) -> tuple[int, ...]:
        """``start(0) .. start(count)``: shard ``j`` holds flat elements ``bounds[j]:bounds[j + 1]``."""
        return tuple(self.start(j) for j in range(self.count + 1))

    def shard(self, flat: np.ndarray, j: int) -> np.ndarray:
        """A new array with shard ``j`` of the flat ``flat`` (zero-padded to ``shard_size``)."""
        validate.index("shard index", j, "count", self.count)
        out = np.zeros(self.shard_size, flat.dtype)
        a, b = self.bounds[j], self.bounds[j + 1]
        out[: b - a] = flat[a:b]
        return out

    def split(self, flat: np.ndarray) -> np.ndarray:
        """All shards of ``flat`` as a new ``[count, shard_size]`` array."""
        s, f = self.shard_size, self.full_shards
        out = np.zeros((self.count, s), flat.dtype)
        out[:f] = flat[: f * s].reshape(f, s)
        if f < self.count and s > 1:
            out[f:, : s - 1] = flat[f * s :].reshape(self.count - f, s - 1)
        return out

    def join(self, shards: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The ``n`` real elements from ``count * shard_size`` concatenated shards (padding dropped)."""
        s, f = self.shard_size, self.full_shards
        padded = np.asarray(shards).reshape(self.count, s)
        if out is None:
            out = np.empty(self.n, padded.dtype)
        out[: f * s] = padded[:f].reshape(-1)
        if f < self.count and s > 1:
            out[f * s :] = padded[f:, : s - 1].reshape(-1)
        return out


def end_bounds(n: int, count: int) -> tuple[int, ...]:
    """Bounds of the plain reduce-scatter layout: contiguous ``ceil(n / count)`` slices, padding at the end."""
    c = -(-n // count)
    return tuple(min(j * c, n) for j in range(count + 1))


@dataclass(frozen=True)
class ShardMeta:
    """What a shard is a shard of: the full (per-group) shape and the sharding domain."""

    meta_shape: tuple[int, ...]
    domain: ReplicaGrouping
    name: str | None = None

    @cached_property
    def layout(self) -> ShardLayout:
        return ShardLayout(math.prod(self.meta_shape), self.domain.group_size)

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return (self.layout.shard_size,)

    def shard_index(self, replica: int) -> int:
        """Which shard global replica ``replica`` holds."""
        return self.domain.index_in_group(replica)

    def describe(self) -> str:
        what = f"variable {self.name!r}" if self.name else "a tensor"
        d = self.domain
        return (f"shard of {what} with full shape {self.meta_shape} over {d.group_size} replica(s) "
                f"(domain {d.describe()})")


class ShardArray(np.ndarray):
    """An ndarray holding one replica's RTS shard; ``meta`` says of what (None once reshaped)."""

    meta: ShardMeta | None

    @classmethod
    def wrap(cls, arr: np.ndarray, meta: ShardMeta) -> ShardArray:
        out = arr.view(cls)
        out.meta = meta if arr.shape == meta.shard_shape else None
        return out

    def __array_finalize__(self, obj: Any) -> None:
        meta = getattr(obj, "meta", None)
        self.meta = meta if meta is not None and self.shape == meta.shard_shape else None


def meta_of(x: Any) -> ShardMeta | None:
    """The shard meta of ``x`` (a :class:`ShardArray` of the right shape), else None."""
    meta = getattr(x, "meta", None) if isinstance(x, ShardArray) else None
    if meta is not None and x.shape != meta.shard_shape:
        return None
    return meta


def sharding_domain(
    grouping: ReplicaGrouping,
    shard_over: int | ReplicaGrouping | CommGroup | None,
    what: str,
) -> ReplicaGrouping:
    """The domain of a variable with ``grouping`` sharded ``shard_over`` ways (see the module docstring).

    ``shard_over`` is PopXL's int (a divisor of the group size; default the group size) or, as
    PopART's sharding domain, a ReplicaGrouping/CommGroup that must split every group of
    ``grouping`` into consecutive members (same stride, a group size that divides it).
    """
    R, t, G = grouping.num_replicas, grouping.stride, grouping.group_size
    if shard_over is None:
        k = G
    elif isinstance(shard_over, (ReplicaGrouping, CommGroup)):
        d = shard_over if isinstance(shard_over, ReplicaGrouping) else shard_over.to_replica_grouping(R)
        if d.num_replicas != R:
            raise ValueError(f"{what}: sharding domain {d} is for {d.num_replicas} replicas, not {R}")
        if not grouping.is_const or not d.is_const:  # irregular: compare the groups themselves
            if G % d.group_size or grouping.split(d.group_size) != d:
                raise ValueError(
                    f"{what}: sharding domain {shard_over!r} does not split the variable's groups ({grouping}) "
                    f"into runs of consecutive members; one that does is {grouping.split(_divisor(G, d.group_size))}"
                )
            return d
        if G % d.group_size or (d.group_size > 1 and d.stride != t):
            raise ValueError(
                f"{what}: sharding domain {shard_over!r} does not split the variable's groups "
                f"({grouping}) into consecutive members: it needs stride={t} and a group_size dividing {G}"
            )
        k = d.group_size
    elif isinstance(shard_over, bool) or not isinstance(shard_over, (int, np.integer)):
        raise TypeError(f"{what}: shard_over must be an int, a ReplicaGrouping or a CommGroup, got {shard_over!r}")
    else:
        k = validate.count(f"{what}: shard_over", shard_over)
        if G % k:
            divisors = [d for d in range(1, G + 1) if G % d == 0]
            raise ValueError(
                f"{what}: shard_over={k} must divide the replica group size {G} of {grouping} "
                f"(one of {divisors})"
            )
    return grouping.split(k)


def _divisor(n: int, k: int) -> int:
    """The largest divisor of ``n`` that is at most ``k``."""
    return max(d for d in range(1, min(n, k) + 1) if n % d == 0)


__all__ = ["ShardArray", "ShardLayout", "ShardMeta", "end_bounds", "meta_of", "sharding_domain"]
