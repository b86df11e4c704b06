"""Replicated collectives and remote buffer access, called inside a step (PopXL's ``popxl.ops`` names).

Each function finds its replica through the step context (:mod:`.context`, per thread or
greenlet). Every replica of the runtime must call the same collectives in the same order: one
call is one meeting of all local replicas (and of all instances); with a ``group`` each replica
is combined only with its own group's members, and different groups are served by the same
call. ``group`` is a
:class:`ReplicaGrouping` from ``rt.replica_grouping(...)``, a :class:`CommGroup`, or None (all
global replicas, across instances). ``replica_sharded_slice``, ``remote_load`` and
``remote_store`` are local to the replica: they do not meet the others.

Results of all-reduce and all-gather are read-only arrays, shared by the members of a group that
run in this process (no per-replica copy of large results); use ``.copy()`` or out-of-place
arithmetic to derive new values. Reduce-scatter and slice results are private, writable arrays.

Float reductions follow a fixed tree over the group's members in member order
(:mod:`popdist_py.engine.reduce`), so results are bitwise identical however the replicas are
split between instances; a reduce-scatter reduces every element with the same tree as an
all-reduce, so ``reduce_scatter(x, RTS)`` is bitwise ``replica_sharded_slice(all_reduce(x))``.

Replicated tensor sharding (:mod:`popdist_py.engine.sharding`): shards are
:class:`~popdist_py.engine.sharding.ShardArray` s (``ctx[shard]``, ``remote_load`` of a sharded
variable's slot, RTS reduce-scatter and ``replica_sharded_slice`` results) that remember the full
shape and the sharding domain, so ``replicated_all_gather`` of one returns the full tensor.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from popdist_py import validate
from popdist_py.engine import context
from popdist_py.engine.exchange import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from popdist_py.engine.grouping import Group
from popdist_py.engine.sharding import ShardArray, ShardMeta, meta_of
from popdist_py.engine.variables import Shard, Variable

_peek = context.peek_fast


def replicated_all_reduce(x: Any, op: str = "add", group: Group = None) -> np.ndarray:
    """Reduce ``x`` over the replica's group: op is add, mean, mul, min or max (PopXL's
    CollectiveOperator names; ``sum`` and ``prod``, the host collectives' names, mean add and mul).

    mean is the sum divided by the group size (floating-point inputs only). Returns a read-only
    array of ``x``'s shape and dtype, equal (bitwise) on every member of the group.
    """
    ctx = _peek() or context.current()  # the hottest call of a step: skip a function layer
    return ctx.collectives.collective(ctx, ALL_REDUCE, x, op, group)


def replicated_all_gather(x: Any, axis: int = 0, group: Group = None) -> np.ndarray:
    """The members' ``x`` concatenated along ``axis`` in member order; for a shard, the full tensor.

    Given an RTS shard (a shard handle from ``rt.replica_sharded_variable``, a sharded variable,
    or a :class:`ShardArray` such as ``ctx[shard]`` or ``remote_load`` of a sharded variable's
    slot) it gathers over the shard's domain and returns the full tensor in its original shape,
    without padding (PopXL's ``output_shape="meta_shape"``); ``group`` may then only be None or
    that domain. Otherwise it concatenates (PopXL's ``"concat"``): for inputs of shape ``s`` the
    result has ``s[axis] * group_size`` along ``axis``; a 0-d input gives ``(group_size,)``.
    Read-only, like :func:`replicated_all_reduce`'s result.
    """
    ctx = context.current()
    rt = ctx.runtime
    if isinstance(x, (Shard, Variable)):
        v = rt.owned_variable(x)
        if v.sharding is None:
            raise ValueError(f"replicated_all_gather: variable {v.name!r} is not replica-sharded; "
                             "read it with ctx[var]")
        x = v.step_value(ctx.local_index)
    meta = meta_of(x)
    if meta is None:
        return ctx.collectives.collective(ctx, ALL_GATHER, x, "", group, axis)
    if group is not None and rt.resolve_group(group) != meta.domain:
        raise ValueError(
            f"replicated_all_gather: group {group!r} is not the sharding domain of this {meta.describe()}; "
            "pass group=None (or that domain) to gather it"
        )
    if axis != 0:
        raise ValueError(f"replicated_all_gather: axis={axis!r}: a shard is flat and is gathered along axis 0")
    return ctx.collectives.collective(ctx, ALL_GATHER, x, "", meta.domain, 0, meta_shape=meta.meta_shape)


def replicated_reduce_scatter(
    x: Any,
    op: str = "add",
    group: Group = None,
    configure_output_for_replicated_tensor_sharding: bool = False,
) -> np.ndarray:
    """Reduce the flattened ``x`` over the group and keep this member's part (ops as for
    :func:`replicated_all_reduce`).

    With ``n`` elements and group size ``G`` every member gets ``ceil(n / G)`` elements.
    Without RTS member ``k`` holds reduced elements ``k*c .. (k+1)*c - 1`` (contiguous slices in
    member order) and the slices of the last members are padded with zeros past ``n``. With
    ``configure_output_for_replicated_tensor_sharding`` the result is member ``k``'s shard in
    the balanced RTS layout of :mod:`popdist_py.engine.sharding` (the layout of a variable
    sharded over ``group``), as a :class:`ShardArray` that gathers back to ``x``'s shape.
    """
    ctx = context.current()
    if not configure_output_for_replicated_tensor_sharding:
        return ctx.collectives.collective(ctx, REDUCE_SCATTER, x, op, group)
    arr = np.asarray(x)
    out = ctx.collectives.collective(ctx, REDUCE_SCATTER, arr, op, group, meta_shape=arr.shape)
    return ShardArray.wrap(out, ShardMeta(arr.shape, ctx.runtime.resolve_group(group)))


def replica_sharded_slice(x: Any, group: Group = None) -> np.ndarray:
    """This member's shard of ``x`` in the RTS layout, without reducing (PopXL's "Local" reduce-scatter).

    ``ceil(n / G)`` elements of the flattened ``x``, laid out (and zero-padded) exactly as the
    shards of a variable sharded over ``group``, so it lines up with ``ctx[shard]`` and gathers
    back to ``x``. Local: it does not meet the other replicas.
    """
    ctx = context.current()
    grouping = ctx.runtime.resolve_group(group)
    arr = np.asarray(x)
    meta = ShardMeta(arr.shape, grouping)
    return ShardArray.wrap(meta.layout.shard(arr.reshape(-1), meta.shard_index(ctx.replica_index)), meta)


def remote_load(buf: Any, offset: int) -> np.ndarray:
    """A private, writable copy of this replica's entry ``offset`` of remote buffer ``buf``.

    When the slot holds a replica-sharded variable the copy is a :class:`ShardArray`, so
    ``replicated_all_gather`` of it gives the full tensor. Store changes back with
    :func:`remote_store`.
    """
    ctx = context.current()
    b = ctx.runtime.owned_buffer(buf, "remote_load")
    what = f"remote_load({b.name!r}, {offset!r}) in replica {ctx.replica_index}"
    i = b.check_offset(offset, what)
    var = b.variable_at(i)
    if var is None:
        raise ValueError(
            f"{what}: entry {i} of remote buffer {b.name!r} holds no variable (entries with variables: "
            f"{b.bound_entries() or 'none'}); create one with rt.remote_variable(data, buffer, offset={i})"
        )
    value = b.slot(ctx.local_index, i).copy()
    return ShardArray.wrap(value, var.sharding) if var.sharding is not None else value


def remote_store(buf: Any, offset: int, x: Any) -> None:
    """Write ``x`` (the buffer's shape and dtype) into this replica's entry ``offset`` of ``buf``."""
    ctx = context.current()
    b = ctx.runtime.owned_buffer(buf, "remote_store")
    what = f"remote_store({b.name!r}, {offset!r}, ...) in replica {ctx.replica_index}"
    i = b.check_offset(offset, what)
    if b.variable_at(i) is None:
        raise ValueError(
            f"{what}: entry {i} of remote buffer {b.name!r} holds no variable, so the value would be lost "
            f"(entries with variables: {b.bound_entries() or 'none'}); create one with "
            f"rt.remote_variable(data, buffer, offset={i})"
        )
    np.copyto(b.slot(ctx.local_index, i), b.check_value(x, what))


def shard_size(n: int | tuple[int, ...], count: int) -> int:
    """Elements per shard of a tensor of ``n`` elements (or that shape) sharded ``count`` ways."""
    total = validate.non_negative("n", n) if isinstance(n, int) else math.prod(n)
    return -(-total // validate.count("count", count))


__all__ = [
    "remote_load",
    "remote_store",
    "replica_sharded_slice",
    "replicated_all_gather",
    "replicated_all_reduce",
    "replicated_reduce_scatter",
    "shard_size",
]
