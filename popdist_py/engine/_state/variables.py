"""Replicated variables: one private value per local replica, grouped over the global replicas.

A :class:`Variable` keeps its description (name, grouping, retrieval mode, shape, dtype) and the
values of this instance's replicas in a storage: private arrays (:class:`LocalStorage`) or the
slots of a remote buffer (:class:`popdist_py.engine._state.remote.RemoteSlots`). A replica-sharded
variable (``sharding`` set) stores only each replica's flat shard (see
:mod:`popdist_py.engine._placement.sharding`); its ``shape`` stays the full per-group shape. The runtime
keeps every variable in a :class:`VariableRegistry`, which checkpoints walk by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from popdist_py.engine._placement.grouping import ReplicaGrouping
from popdist_py.engine._placement.replicas import ReplicaPlacement
from popdist_py.engine._placement.sharding import ShardArray, ShardMeta

if TYPE_CHECKING:  # pragma: no cover
    from popdist_py.engine._collectives.transport import Transport

RETRIEVAL_MODES = ("one_per_group", "all_replicas")


def check_retrieval_mode(mode: str) -> str:
    if mode not in RETRIEVAL_MODES:
        raise ValueError(f"retrieval_mode={mode!r} is invalid: use one of {', '.join(map(repr, RETRIEVAL_MODES))}")
    return mode


def host_shape(grouping: ReplicaGrouping, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Host-side shape of a variable: a leading group axis when there is more than one group."""
    return (grouping.num_groups, *shape) if grouping.num_groups > 1 else shape


#: dtype kinds that are not numbers (object and structured dtypes are refused as well).
_NOT_NUMERIC = {"U": "str", "S": "bytes", "V": "void/raw bytes", "O": "object", "M": "datetime", "m": "timedelta"}


def as_host_array(data: Any, dtype: Any, what: str) -> np.ndarray:
    """``data`` as an array of ``dtype`` (same-kind casts only: float64 -> float32 is fine, float -> int is not)."""
    arr = np.asarray(data)
    if dtype is None:
        dtype = arr.dtype
    dtype = np.dtype(dtype)
    if dtype.hasobject or dtype.fields is not None or dtype.kind in _NOT_NUMERIC:
        kind = f" ({_NOT_NUMERIC[dtype.kind]})" if dtype.kind in _NOT_NUMERIC else ""
        raise TypeError(f"{what}: dtype {dtype}{kind} is not supported (use a numeric or bool dtype)")
    if arr.dtype != dtype:
        if not np.can_cast(arr.dtype, dtype, casting="same_kind"):
            raise TypeError(f"{what}: cannot convert data of dtype {arr.dtype} to {dtype}")
        arr = arr.astype(dtype)
    return arr


def per_group_values(data: np.ndarray, grouping: ReplicaGrouping, what: str) -> list[np.ndarray]:
    """Split host data into one value per group (the leading axis when there are several groups)."""
    if grouping.num_groups == 1:
        return [data]
    if data.ndim == 0 or data.shape[0] != grouping.num_groups:
        raise ValueError(
            f"{what}: host data of shape {data.shape} needs a leading axis of {grouping.num_groups} "
            f"(one value per group of {grouping})"
        )
    return [data[g] for g in range(grouping.num_groups)]


class Storage(Protocol):
    """Where a variable's per-local-replica values live."""

    def get(self, local_index: int) -> np.ndarray:
        """The stored value itself (no copy)."""

    def put(self, local_index: int, value: np.ndarray) -> None:
        """Store ``value`` (already checked for shape and dtype) for one replica."""

    def nbytes(self) -> tuple[int, int]:
        """(bytes held in memory, bytes held in files)."""


def _is_view_of(value: np.ndarray, stored: np.ndarray) -> bool:
    """True when ``value`` is exactly the memory of ``stored`` (e.g. it was modified in place)."""
    if value is stored:
        return True
    return (value.shape == stored.shape and value.strides == stored.strides and value.size > 0
            and value.__array_interface__["data"][0] == stored.__array_interface__["data"][0])


class LocalStorage:
    """One private C-contiguous array per local replica."""

    __slots__ = ("values",)

    def __init__(self, count: int) -> None:
        self.values: list[np.ndarray | None] = [None] * count

    def get(self, local_index: int) -> np.ndarray:
        value = self.values[local_index]
        assert value is not None, "variable used before it was loaded"
        return value

    def put(self, local_index: int, value: np.ndarray) -> None:
        stored = self.values[local_index]
        if stored is not None and _is_view_of(value, stored):
            return  # written in place through a shard view: nothing to copy
        self.values[local_index] = np.array(value, order="C", copy=True)

    def nbytes(self) -> tuple[int, int]:
        return sum(v.nbytes for v in self.values if v is not None), 0


class Variable:
    """A variable of a Runtime: ``shape``/``dtype`` per replica (the full shape when sharded),
    one value per group on the host."""

    def __init__(
        self,
        name: str,
        grouping: ReplicaGrouping,
        retrieval_mode: str,
        shape: tuple[int, ...],
        dtype: np.dtype,
        values: list[np.ndarray] | None,
        offset: int,
        *,
        sharding: ShardMeta | None = None,
        storage: Storage | None = None,
        num_local_replicas: int | None = None,
    ) -> None:
        self.name = name
        self.replica_grouping = grouping
        self.retrieval_mode = check_retrieval_mode(retrieval_mode)
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.replica_index_offset = offset
        #: RTS: what each replica's stored shard is a shard of (None: every replica holds ``shape``)
        self.sharding = sharding
        if storage is None:
            count = len(values) if values is not None else num_local_replicas
            assert count is not None
            local = LocalStorage(count)
            if values is not None:
                local.values = list(values)
            storage = local
        self.storage: Storage = storage
        self._count = num_local_replicas if num_local_replicas is not None else len(values or [])
        self._handle: Shard | None = None

    @property
    def shape_on_host(self) -> tuple[int, ...]:
        return host_shape(self.replica_grouping, self.shape)

    @property
    def shape_on_replica(self) -> tuple[int, ...]:
        """What one replica stores: ``shape``, or ``(shard_size,)`` when sharded."""
        return self.sharding.shard_shape if self.sharding is not None else self.shape

    @property
    def is_sharded(self) -> bool:
        return self.sharding is not None

    @property
    def is_remote(self) -> bool:
        return getattr(self.storage, "buffer", None) is not None

    @property
    def remote_buffer(self) -> Any:
        """The :class:`~popdist_py.engine._state.remote.RemoteBuffer` holding the values, or None."""
        return getattr(self.storage, "buffer", None)

    @property
    def remote_offset(self) -> int | None:
        return getattr(self.storage, "offset", None)

    @property
    def shard(self) -> Shard:
        """The shard handle of a sharded variable (what ``replica_sharded_variable`` returns second)."""
        if self.sharding is None:
            raise ValueError(f"variable {self.name!r} is not replica-sharded")
        if self._handle is None:
            self._handle = Shard(self)
        return self._handle

    @property
    def nbytes(self) -> int:
        """Bytes of one replica's stored value."""
        return math.prod(self.shape_on_replica) * self.dtype.itemsize

    @property
    def num_local_replicas(self) -> int:
        return self._count

    def local_value(self, local_index: int) -> np.ndarray:
        """The stored value of local replica ``local_index`` (the array itself: do not modify)."""
        return self.storage.get(local_index)

    def set_local_value(self, local_index: int, value: Any, what: str | None = None) -> None:
        """Store ``value`` for one local replica (a private copy), after checking shape and dtype."""
        self.storage.put(local_index, self._check(value, what))

    def step_value(self, local_index: int) -> np.ndarray:
        """What ``ctx[var]`` gives a step: a read-only snapshot, or for a sharded variable the
        replica's writable shard (a :class:`ShardArray` that gathers back to the full tensor)."""
        stored = self.storage.get(local_index)
        remote = self.is_remote
        if self.sharding is not None:
            return ShardArray.wrap(stored.copy() if remote else stored, self.sharding)
        value = stored.copy() if remote else stored.view()
        value.flags.writeable = False
        return value

    def _check(self, value: Any, what: str | None) -> np.ndarray:
        what = what or f"variable {self.name!r}"
        if isinstance(value, np.ndarray):
            if value.dtype != self.dtype:
                raise TypeError(f"{what}: value has dtype {value.dtype} but the variable is {self.dtype}")
            arr = value
        else:
            arr = np.asarray(value, dtype=self.dtype)
        want = self.shape_on_replica
        if arr.shape != want:
            kind = "shard" if self.sharding is not None else "variable's"
            raise ValueError(f"{what}: value has shape {arr.shape} but the {kind} shape is {want}")
        return arr

    def checked(self, value: Any, what: str | None = None) -> np.ndarray:
        """A private, C-contiguous copy of ``value``; TypeError/ValueError naming the mismatch."""
        return np.array(self._check(value, what), dtype=self.dtype, order="C", copy=True)

    def load_groups(self, group_values: Sequence[np.ndarray]) -> None:
        """Give every local replica its group's value (or, when sharded, its shard of it)."""
        g = self.replica_grouping
        meta = self.sharding
        for r in range(self._count):
            replica = self.replica_index_offset + r
            value = group_values[g.group_of(replica)]
            if meta is not None:
                full = np.asarray(value).reshape(-1)
                if full.size != meta.layout.n:
                    raise ValueError(f"variable {self.name!r}: value of shape {np.shape(value)} is not {self.shape}")
                value = meta.layout.shard(full, meta.shard_index(replica))
            self.storage.put(r, self._check(value, None))  # the storage keeps its own copy

    def holders(self) -> list[int]:
        """Global replicas whose stored values make up the host value (ascending)."""
        g = self.replica_grouping
        if self.sharding is not None:  # the first domain of each group: one shard each
            k = self.sharding.domain.group_size
            return sorted(m for grp in range(g.num_groups) for m in g.members(grp)[:k])
        if self.retrieval_mode == "all_replicas":
            return list(range(g.num_replicas))
        return [g.first(k) for k in range(g.num_groups)]

    def assemble(self, stored: np.ndarray) -> np.ndarray:
        """The host value from the stored values of :meth:`holders` (``[len(holders), *shape_on_replica]``)."""
        g = self.replica_grouping
        if self.sharding is None:
            return stored.reshape(self.shape_on_host if self.retrieval_mode == "one_per_group"
                                  else (g.num_replicas, *self.shape))
        meta = self.sharding
        k = meta.domain.group_size
        index = {r: i for i, r in enumerate(self.holders())}
        out = np.empty((g.num_groups, meta.layout.n), self.dtype)
        for grp in range(g.num_groups):
            rows = [index[m] for m in g.members(grp)[:k]]  # shard order = member order in the domain
            meta.layout.join(stored[rows], out=out[grp])
        return out.reshape(self.shape_on_host)

    def __repr__(self) -> str:
        extra = ""
        if self.sharding is not None:
            extra += f", sharded over {self.sharding.domain.group_size} (shard shape {self.shape_on_replica})"
        if self.is_remote:
            extra += f", remote buffer {self.remote_buffer.name!r} entry {self.remote_offset}"
        return (
            f"Variable(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, "
            f"replica_grouping={self.replica_grouping}, retrieval_mode={self.retrieval_mode!r}{extra})"
        )


class Shard:
    """The shard handle of a replica-sharded variable (PopXL's second return value).

    Inside a step ``ctx[shard]`` is this replica's flat shard (read/write) and
    ``ops.replicated_all_gather(shard)`` the full tensor; on the host it stands for its variable.
    """

    __slots__ = ("variable",)

    def __init__(self, variable: Variable) -> None:
        self.variable = variable

    @property
    def meta(self) -> ShardMeta:
        assert self.variable.sharding is not None
        return self.variable.sharding

    @property
    def shape(self) -> tuple[int, ...]:
        return self.variable.shape_on_replica

    @property
    def meta_shape(self) -> tuple[int, ...]:
        return self.variable.shape

    @property
    def dtype(self) -> np.dtype:
        return self.variable.dtype

    @property
    def domain(self) -> ReplicaGrouping:
        """The replicas that together hold one full copy (the group to gather and scatter over)."""
        return self.meta.domain

    @property
    def name(self) -> str:
        return self.variable.name

    def __repr__(self) -> str:
        return f"Shard(of {self.variable.name!r}, shape={self.shape}, full shape={self.meta_shape})"


def collect(
    placement: ReplicaPlacement,
    transport: Transport | None,
    replicas: Sequence[int],
    get: Callable[[int], np.ndarray],
    item_shape: tuple[int, ...],
    dtype: np.dtype,
    what: str,
    root: int | None = None,
) -> np.ndarray | None:
    """``[len(replicas), *item_shape]``: ``get(local index)`` of each of the (ascending) global
    ``replicas``, from whichever instance holds it.

    Exact: raw bytes move with one ``Allgatherv`` (or ``Gatherv`` to ``root``, None elsewhere).
    """
    L, off = placement.num_local_replicas, placement.replica_index_offset
    item = math.prod(item_shape) * dtype.itemsize
    if transport is None:
        out = np.empty((len(replicas), *item_shape), dtype)
        for k, r in enumerate(replicas):
            out[k] = get(r - off)
        return out
    mine = [r for r in replicas if off <= r < off + L]
    send = np.empty((len(mine), *item_shape), dtype)
    for k, r in enumerate(mine):
        send[k] = get(r - off)
    counts = [sum(1 for r in replicas if placement.owner(r) == i) * item for i in range(placement.num_instances)]
    if root is not None and transport.rank != root:
        transport.gatherv(send.reshape(-1).view(np.uint8), counts, None, root, what)
        return None
    out = np.empty((len(replicas), *item_shape), dtype)
    recv = out.reshape(-1).view(np.uint8)
    if root is None:
        transport.allgatherv(send.reshape(-1).view(np.uint8), counts, recv, what)
    else:
        transport.gatherv(send.reshape(-1).view(np.uint8), counts, recv, root, what)
    return out


def host_value(
    v: Variable, placement: ReplicaPlacement, transport: Transport | None, root: int | None = None
) -> np.ndarray | None:
    """The global host value of ``v`` per its retrieval mode (collective across instances).

    ``one_per_group``: each group's first replica, shape ``shape_on_host`` (for a sharded
    variable: the shards of each group's first domain, joined and un-padded); ``all_replicas``:
    every replica, shape ``(R, *shape)``. Every instance contributes the values it holds (see
    :func:`collect`), after ``agree`` has checked that every instance asks for the same variable.
    With ``root`` only that instance gets the value (the others get None).
    """
    what = f"get_tensor_data({v.name!r})"
    if transport is not None:
        transport.agree(what, (v.name, v.shape, str(v.dtype), v.retrieval_mode, v.shape_on_replica),
                        ("variable", "shape", "dtype", "retrieval mode", "stored shape"))
    stored = collect(placement, transport, v.holders(), v.local_value, v.shape_on_replica, v.dtype, what, root)
    return None if stored is None else v.assemble(stored)


class VariableRegistry:
    """The variables of one runtime by name; names are unique, unnamed variables get generated ones."""

    def __init__(self) -> None:
        self._by_name: dict[str, Variable] = {}
        self._counter = 0

    def new_name(self, prefix: str = "variable") -> str:
        while True:
            name = f"{prefix}_{self._counter}"
            self._counter += 1
            if name not in self._by_name:
                return name

    def check_name(self, name: str) -> str:
        if not isinstance(name, str) or not name:
            raise TypeError(f"a variable name must be a non-empty str, got {name!r}")
        if name in self._by_name:
            raise ValueError(f"a variable named {name!r} already exists: {self._by_name[name]!r}")
        return name

    def add(self, var: Variable) -> Variable:
        self.check_name(var.name)
        self._by_name[var.name] = var
        return var

    def owns(self, var: Any) -> bool:
        if isinstance(var, Shard):
            var = var.variable
        return isinstance(var, Variable) and self._by_name.get(var.name) is var

    def __getitem__(self, name: str) -> Variable:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[Variable]:
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)

    def names(self) -> list[str]:
        return list(self._by_name)
