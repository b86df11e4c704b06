"""Replicated variables: one private value per local replica, grouped over the global replicas.

A :class:`Variable` keeps its description (name, grouping, retrieval mode, shape, dtype) and the
values of this instance's replicas. The runtime keeps every variable in a
:class:`VariableRegistry`; later features (replica-sharded variables, remote buffers, checkpoints)
are built on the same two pieces: per-local-replica storage and a registry indexed by name.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from popdist_py.engine.grouping import ReplicaGrouping
from popdist_py.engine.topology import Layout

if TYPE_CHECKING:  # pragma: no cover
    from popdist_py.engine.transport import Transport

RETRIEVAL_MODES = ("one_per_group", "all_replicas")


def check_retrieval_mode(mode: str) -> str:
    if mode not in RETRIEVAL_MODES:
        raise ValueError(f"retrieval_mode={mode!r} is invalid: use one of {', '.join(map(repr, RETRIEVAL_MODES))}")
    return mode


def host_shape(grouping: ReplicaGrouping, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Host-side shape of a variable: a leading group axis when there is more than one group."""
    return (grouping.num_groups, *shape) if grouping.num_groups > 1 else shape


def as_host_array(data: Any, dtype: Any, what: str) -> np.ndarray:
    """``data`` as an array of ``dtype`` (same-kind casts only: float64 -> float32 is fine, float -> int is not)."""
    arr = np.asarray(data)
    if dtype is None:
        dtype = arr.dtype
    dtype = np.dtype(dtype)
    if dtype.hasobject or dtype.fields is not None:
        raise TypeError(f"{what}: dtype {dtype} is not supported (use a numeric or bool dtype)")
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


class Variable:
    """A variable of a Runtime: ``shape``/``dtype`` per replica, one value per group on the host."""

    def __init__(
        self,
        name: str,
        grouping: ReplicaGrouping,
        retrieval_mode: str,
        shape: tuple[int, ...],
        dtype: np.dtype,
        values: list[np.ndarray],
        offset: int,
    ) -> None:
        self.name = name
        self.replica_grouping = grouping
        self.retrieval_mode = check_retrieval_mode(retrieval_mode)
        self.shape = shape
        self.dtype = dtype
        self.replica_index_offset = offset
        self._values = values

    @property
    def shape_on_host(self) -> tuple[int, ...]:
        return host_shape(self.replica_grouping, self.shape)

    @property
    def shape_on_replica(self) -> tuple[int, ...]:
        return self.shape

    @property
    def nbytes(self) -> int:
        """Bytes of one replica's value."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def num_local_replicas(self) -> int:
        return len(self._values)

    def local_value(self, local_index: int) -> np.ndarray:
        """The stored value of local replica ``local_index`` (the array itself: do not modify)."""
        return self._values[local_index]

    def set_local_value(self, local_index: int, value: Any, what: str | None = None) -> None:
        """Store a private copy of ``value`` for one local replica, after checking shape and dtype."""
        self._values[local_index] = self.checked(value, what)

    def checked(self, value: Any, what: str | None = None) -> np.ndarray:
        """A private, C-contiguous copy of ``value``; TypeError/ValueError naming the mismatch."""
        what = what or f"variable {self.name!r}"
        if isinstance(value, np.ndarray):
            if value.dtype != self.dtype:
                raise TypeError(f"{what}: value has dtype {value.dtype} but the variable is {self.dtype}")
            arr = value
        else:
            arr = np.asarray(value, dtype=self.dtype)
        if arr.shape != self.shape:
            raise ValueError(f"{what}: value has shape {arr.shape} but the variable's shape is {self.shape}")
        return np.array(arr, dtype=self.dtype, order="C", copy=True)

    def load_groups(self, group_values: Sequence[np.ndarray]) -> None:
        """Give every local replica a private copy of its group's value."""
        g = self.replica_grouping
        for r in range(len(self._values)):
            self._values[r] = self.checked(group_values[g.group_of(self.replica_index_offset + r)])

    def __repr__(self) -> str:
        return (
            f"Variable(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, "
            f"replica_grouping={self.replica_grouping}, retrieval_mode={self.retrieval_mode!r})"
        )


def host_value(v: Variable, layout: Layout, transport: Transport | None) -> np.ndarray:
    """The global host value of ``v`` per its retrieval mode (collective across instances).

    ``one_per_group``: each group's first replica, shape ``shape_on_host``; ``all_replicas``:
    every replica, shape ``(R, *shape)``. Each instance contributes the values it holds with one
    ``Allgatherv`` of raw bytes (exact: no arithmetic on the values), after ``agree`` has checked
    that every instance asks for the same variable.
    """
    g = v.replica_grouping
    L, off, R = layout.local_replicas, layout.offset, layout.replication_factor
    if v.retrieval_mode == "all_replicas":
        holders = list(range(R))
        out_shape: tuple[int, ...] = (R, *v.shape)
    else:
        holders = [g.first(k) for k in range(g.num_groups)]
        out_shape = host_shape(g, v.shape)
    out = np.empty((len(holders), *v.shape), v.dtype)
    if transport is None:
        for k, r in enumerate(holders):
            out[k] = v.local_value(r - off)
        return out.reshape(out_shape)
    what = f"get_tensor_data({v.name!r})"
    transport.agree(what, (v.name, v.shape, str(v.dtype), v.retrieval_mode),
                    ("variable", "shape", "dtype", "retrieval mode"))
    mine = [r for r in holders if off <= r < off + L]
    send = np.empty((len(mine), *v.shape), v.dtype)
    for k, r in enumerate(mine):
        send[k] = v.local_value(r - off)
    counts = [sum(1 for r in holders if layout.owner(r) == i) * v.nbytes for i in range(layout.num_instances)]
    transport.allgatherv(send.reshape(-1).view(np.uint8), counts, out.reshape(-1).view(np.uint8), what)
    return out.reshape(out_shape)


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
