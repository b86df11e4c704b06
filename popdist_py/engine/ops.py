"""Replicated collectives and remote buffer access, called inside a step (PopXL's ``popxl.ops`` names).

Each function finds its replica through the step context (:mod:`.context`, per thread or
greenlet). Every replica of the runtime must call the same collectives in the same order: one
call is one meeting of all local replicas (and of all instances); with a ``group`` each replica
is combined only with its own group's members, and different groups are served by the same
call. ``group`` is a :class:`ReplicaGrouping` from ``rt.replica_grouping(...)`` or
``rt.replica_grouping_from_assignments(...)`` (irregular groupings work in every collective: a
group's members are taken in ascending replica order), a :class:`CommGroup`, or None (all
global replicas, across instances). ``replica_sharded_slice``, ``replicated_slice``,
``remote_load`` and ``remote_store`` are local to the replica: they do not meet the others.

Results of all-reduce and all-gather are read-only arrays, shared by the members of a group that
run in this process (no per-replica copy of large results); use ``.copy()`` or out-of-place
arithmetic to derive new values, or ``replicated_all_reduce_`` to reduce a writable array in
place. Reduce-scatter and slice results are private, writable arrays.

Float reductions follow a fixed tree over the group's members in member order
(:mod:`popdist_py.engine._collectives.reduce`), so results are bitwise identical however the replicas are
split between instances; a reduce-scatter reduces every element with the same tree as an
all-reduce, so ``reduce_scatter(x, RTS)`` is bitwise ``replica_sharded_slice(all_reduce(x))``.

Replicated tensor sharding (:mod:`popdist_py.engine._placement.sharding`): shards are
:class:`~popdist_py.engine._placement.sharding.ShardArray` s (``ctx[shard]``, ``remote_load`` of a sharded
variable's slot, RTS reduce-scatter and ``replica_sharded_slice`` results) that remember the full
shape and the sharding domain, so ``replicated_all_gather`` of one returns the full tensor.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from popdist_py import validate
from popdist_py.engine._collectives.exchange import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from popdist_py.engine._placement.grouping import Group
from popdist_py.engine._placement.sharding import ShardArray, ShardMeta, meta_of
from popdist_py.engine._state.variables import Shard, Variable
from popdist_py.engine._step import context

_peek = context.peek_fast


def replicated_all_reduce(x: Any, op: str = "add", group: Group = None) -> np.ndarray:
    """Reduce ``x`` over the replica's group: op is add, mean, mul, min, max, square_add, and or
    or (PopXL's CollectiveOperator names; ``sum`` and ``prod``, the host collectives' names, mean
    add and mul).

    mean is the sum divided by the group size (floating-point inputs only); square_add the sum of
    the members' squares (numbers, not bool); and/or are logical, on bool inputs only (as in
    PopXL). Returns a read-only array of ``x``'s shape and dtype, equal (bitwise) on every member
    of the group.
    """
    ctx = _peek() or context.current()  # the hottest call of a step: skip a function layer
    return ctx.collectives.collective(ctx, ALL_REDUCE, x, op, group)


def replicated_all_reduce_(x: np.ndarray, op: str = "add", group: Group = None) -> np.ndarray:
    """:func:`replicated_all_reduce` in place (PopXL's ``replicated_all_reduce_``): the result is
    written into ``x``, which is returned.

    ``x`` must be a writable numpy array; ``ctx[var]`` and the results of all-reduce and
    all-gather are read-only (reduce a copy, or use :func:`replicated_all_reduce`). A sharded
    variable's ``ctx[shard]`` is writable: reducing it in place changes the stored shard.
    """
    ctx = _peek() or context.current()
    if not isinstance(x, np.ndarray):
        raise TypeError(f"replicated_all_reduce_: x must be a numpy array to write the result into, got "
                        f"{type(x).__name__}; use replicated_all_reduce for other inputs")
    if not x.flags.writeable:
        raise ValueError(f"replicated_all_reduce_: x (shape {x.shape}, dtype {x.dtype}) is read-only, as ctx[var] and "
                         "collective results are; reduce a writable copy (x.copy()) or use replicated_all_reduce")
    np.copyto(x, ctx.collectives.collective(ctx, ALL_REDUCE, x, op, group))
    return x


#: ``output_shape`` values of :func:`replicated_all_gather` (PopXL's).
OUTPUT_SHAPES = ("new_axis", "concat", "meta_shape", "auto")


def replicated_all_gather(x: Any, axis: int = 0, group: Group = None, output_shape: str = "auto") -> np.ndarray:
    """The members' ``x`` in member order, shaped as ``output_shape`` says (PopXL's modes).

    - ``"concat"``: concatenated along ``axis``: for inputs of shape ``s`` the result has
      ``s[axis] * group_size`` along ``axis``; a 0-d input gives ``(group_size,)``.
    - ``"new_axis"``: stacked along a new leading axis, ``(group_size, *s)`` (``axis`` must be 0).
    - ``"meta_shape"``: for an RTS shard, the full tensor in its original shape without padding.
      The input is a shard handle from ``rt.replica_sharded_variable``, a sharded variable, or a
      :class:`ShardArray` such as ``ctx[shard]`` or ``remote_load`` of a sharded variable's slot;
      it is gathered over the shard's domain, so ``group`` may only be None or that domain.
    - ``"auto"`` (default): ``"meta_shape"`` for a shard, otherwise ``"concat"``.

    Read-only, like :func:`replicated_all_reduce`'s result.
    """
    if not isinstance(output_shape, str) or output_shape not in OUTPUT_SHAPES:
        raise ValueError(f"replicated_all_gather: output_shape={output_shape!r} is not valid; use one of "
                         f"{', '.join(map(repr, OUTPUT_SHAPES))}")
    ctx = context.current()
    rt = ctx.runtime
    if isinstance(x, (Shard, Variable)):
        v = rt.owned_variable(x)
        if v.sharding is None:
            raise ValueError(f"replicated_all_gather: variable {v.name!r} is not replica-sharded; "
                             "read it with ctx[var]")
        x = v.step_value(ctx.local_index)
    meta = meta_of(x)
    mode = ("meta_shape" if meta is not None else "concat") if output_shape == "auto" else output_shape
    if mode == "concat":
        return ctx.collectives.collective(ctx, ALL_GATHER, x, "", group, axis)
    if axis != 0:
        raise ValueError(f"replicated_all_gather: axis={axis!r} is only for output_shape='concat'; "
                         f"output_shape={mode!r} gathers along a new or the flat leading axis (axis=0)")
    if mode == "new_axis":  # a concat of the inputs with a leading axis of 1: the same exchange
        return ctx.collectives.collective(ctx, ALL_GATHER, np.asarray(x)[np.newaxis], "", group, 0)
    if meta is None:
        raise ValueError(
            f"replicated_all_gather: output_shape='meta_shape' needs a replica-sharded input (a shard handle or a "
            f"ShardArray such as ctx[shard]); got a {type(x).__name__} of shape {np.shape(x)} with no full shape"
        )
    if group is not None and rt.resolve_group(group) != meta.domain:
        raise ValueError(
            f"replicated_all_gather: group {group!r} is not the sharding domain of this {meta.describe()}; "
            "pass group=None (or that domain) to gather it"
        )
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
    the balanced RTS layout of :mod:`popdist_py.engine._placement.sharding` (the layout of a variable
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


def replicated_slice(x: Any, axis: int = 0, group: Group = None) -> np.ndarray:
    """This member's equal part of ``x`` along ``axis`` (PopXL's ``replicated_slice``).

    The group size ``G`` must divide ``x.shape[axis]``; member ``k`` takes
    ``[k * c : (k + 1) * c]`` with ``c = x.shape[axis] // G``. As in PopXL, when ``c`` is 1 the
    axis is dropped, so the slice undoes an all-gather with ``output_shape="new_axis"``
    (and for ``c > 1`` a ``"concat"`` gather along ``axis`` undoes the slice). Unlike
    :func:`replica_sharded_slice` the shape is kept and nothing is flattened or padded. Local: it
    does not meet the other replicas. Returns a private, writable array.
    """
    ctx = context.current()
    grouping = ctx.runtime.resolve_group(group)
    arr = np.asarray(x)
    if arr.ndim == 0:
        raise ValueError("replicated_slice: x is 0-d: it has no axis to slice (give it at least one axis)")
    axis = validate.integer("replicated_slice: axis", axis)
    if not -arr.ndim <= axis < arr.ndim:
        raise ValueError(f"replicated_slice: axis={axis} is out of range for an input of shape {arr.shape} "
                         f"(valid: {-arr.ndim}..{arr.ndim - 1})")
    axis %= arr.ndim
    n, G = arr.shape[axis], grouping.group_size
    if n % G:
        raise ValueError(
            f"replicated_slice: axis {axis} of an input of shape {arr.shape} has length {n}, which the group size "
            f"{G} does not divide (every member takes an equal slice; valid lengths are multiples of {G})"
        )
    c = n // G
    k = grouping.index_in_group(ctx.replica_index)
    index: list[int | slice] = [slice(None)] * arr.ndim
    index[axis] = k if c == 1 else slice(k * c, (k + 1) * c)
    return np.array(arr[tuple(index)], copy=True)


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
    "OUTPUT_SHAPES",
    "remote_load",
    "remote_store",
    "replica_sharded_slice",
    "replicated_all_gather",
    "replicated_all_reduce",
    "replicated_all_reduce_",
    "replicated_reduce_scatter",
    "replicated_slice",
    "shard_size",
]
