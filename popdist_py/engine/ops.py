"""Replicated collectives, called inside a step (PopXL's ``popxl.ops.collectives`` names).

Each function finds its replica through the thread-local step context. Every replica of the
runtime must call the same collectives in the same order: one call is one meeting of all local
replicas (and of all instances); with a ``group`` each replica is combined only with its own
group's members, and different groups are served by the same call. ``group`` is a
:class:`ReplicaGrouping` from ``rt.replica_grouping(...)``, a :class:`CommGroup`, or None (all
global replicas, across instances).

Results of all-reduce and all-gather are read-only arrays, shared by the members of a group that
run in this process (no per-replica copy of large results); use ``.copy()`` or out-of-place
arithmetic to derive new values. Reduce-scatter and slice results are private, writable arrays.

Float reductions follow a fixed tree over the group's members in member order
(:mod:`popdist_py.engine.reduce`), so results are bitwise identical however the replicas are
split between instances.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from popdist_py.engine import context
from popdist_py.engine.collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, shard_slice
from popdist_py.engine.grouping import CommGroup, ReplicaGrouping

Group = ReplicaGrouping | CommGroup | None


def replicated_all_reduce(x: Any, op: str = "add", group: Group = None) -> np.ndarray:
    """Reduce ``x`` over the replica's group: op is add, mean, mul, min or max.

    mean is the sum divided by the group size (floating-point inputs only). Returns a read-only
    array of ``x``'s shape and dtype, equal (bitwise) on every member of the group.
    """
    ctx = context.current()
    return ctx.runtime.collective(ctx, ALL_REDUCE, x, op, group)


def replicated_all_gather(x: Any, axis: int = 0, group: Group = None) -> np.ndarray:
    """The members' ``x`` concatenated along ``axis`` in member order (PopXL's ``output_shape="concat"``).

    Read-only, like :func:`replicated_all_reduce`'s result.
    For inputs of shape ``s`` the result has ``s[axis] * group_size`` along ``axis``; a 0-d input
    gives shape ``(group_size,)``. Use ``result.reshape(group_size, *s)`` (axis 0) to get the
    members stacked on a new axis.
    """
    ctx = context.current()
    return ctx.runtime.collective(ctx, ALL_GATHER, x, "", group, axis)


def replicated_reduce_scatter(
    x: Any,
    op: str = "add",
    group: Group = None,
    configure_output_for_replicated_tensor_sharding: bool = False,
) -> np.ndarray:
    """Reduce the flattened ``x`` over the group and keep this member's contiguous slice.

    With ``n`` elements and group size ``G`` every member gets ``ceil(n / G)`` elements: member
    ``k`` holds reduced elements ``k*c .. (k+1)*c - 1``; the slices of the last members are
    padded with zeros past ``n``. The RTS layout (``configure_output_for_replicated_tensor_sharding``)
    is not implemented yet.
    """
    if configure_output_for_replicated_tensor_sharding:
        raise NotImplementedError("replicated tensor sharding layouts are not implemented yet")
    ctx = context.current()
    return ctx.runtime.collective(ctx, REDUCE_SCATTER, x, op, group)


def replica_sharded_slice(x: Any, group: Group = None) -> np.ndarray:
    """This member's slice of the flattened ``x`` (no reduction, no communication).

    The same slicing as :func:`replicated_reduce_scatter`: ``ceil(n / G)`` elements, zero-padded.
    It is local: it does not meet the other replicas.
    """
    ctx = context.current()
    grouping = ctx.runtime._grouping(group)
    r = ctx.replica_index
    return shard_slice(np.asarray(x), grouping.index_in_group(r), grouping.group_size)


__all__ = [
    "replica_sharded_slice",
    "replicated_all_gather",
    "replicated_all_reduce",
    "replicated_reduce_scatter",
]
