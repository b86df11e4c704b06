"""The replica a piece of code runs as: a :class:`StepContext` in a context variable, set by ``Runtime.run``.

Collectives find their replica through it, so ``ops.replicated_all_reduce(x)`` needs no handle.
A ``contextvars.ContextVar`` rather than thread-local storage: every thread has its own context
and so does every greenlet (greenlet >= 1), so it names the right replica under both executors,
threads and cooperative greenlets sharing one thread (thread-locals would be shared by them).

What a step needs of its runtime is stated here as protocols (:class:`StepRuntime`,
:class:`Collectives`), which :class:`.runtime.Runtime` and :class:`.dispatch.Dispatcher` satisfy,
so this module imports neither: the runtime, above it, imports it, and the dispatcher, below it,
knows a replica only as a :class:`.dispatch.Caller`.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Protocol

import numpy as np

from popdist_py.engine._placement.grouping import Group, ReplicaGrouping
from popdist_py.engine._state.remote import RemoteBuffer
from popdist_py.engine._state.variables import Shard, Variable

_current: ContextVar[StepContext | None] = ContextVar("popdist_step_context", default=None)


class StepRuntime(Protocol):
    """What a step (its context and :mod:`.ops`) uses of its runtime."""

    @property
    def replication_factor(self) -> int: ...

    @property
    def instance_index(self) -> int: ...

    @property
    def replica_index_offset(self) -> int: ...

    def owned_variable(self, var: Any) -> Variable: ...

    def owned_buffer(self, buf: Any, what: str) -> RemoteBuffer: ...

    def resolve_group(self, group: Group) -> ReplicaGrouping: ...


class Collectives(Protocol):
    """Where a replica enters a collective (:class:`.dispatch.Dispatcher`)."""

    def collective(
        self, ctx: StepContext, kind: str, x: Any, op: str, group: Group, axis: int = 0,
        meta_shape: tuple[int, ...] | None = None,
    ) -> np.ndarray: ...


class StepContext:
    """What a step sees of its replica: indices, and its own value of every variable."""

    __slots__ = ("collectives", "local_index", "ncoll", "replica_index", "runtime")

    def __init__(self, runtime: StepRuntime, collectives: Collectives, local_index: int) -> None:
        self.runtime = runtime
        #: the runtime's collective dispatcher (what :mod:`.ops` calls)
        self.collectives = collectives
        self.local_index = local_index
        self.replica_index = runtime.replica_index_offset + local_index
        self.ncoll = 0  # collectives this replica has entered in the current step

    @property
    def instance_index(self) -> int:
        return self.runtime.instance_index

    @property
    def replication_factor(self) -> int:
        return self.runtime.replication_factor

    def __getitem__(self, var: Variable | Shard) -> np.ndarray:
        """This replica's value (read-only; assign ``ctx[var] = new`` to change it).

        For a replica-sharded variable (or its shard handle): this replica's flat shard, writable
        (``ctx[shard] -= update`` works) and gatherable with ``ops.replicated_all_gather``.
        """
        return self.runtime.owned_variable(var).step_value(self.local_index)

    def __setitem__(self, var: Variable | Shard, value: Any) -> None:
        v = self.runtime.owned_variable(var)
        v.set_local_value(self.local_index, value, f"ctx[{v.name!r}] = ... in replica {self.replica_index}")

    def __repr__(self) -> str:
        return f"StepContext(replica_index={self.replica_index}, local_index={self.local_index})"


def current() -> StepContext:
    """The context of the replica running here (thread or greenlet); RuntimeError outside ``Runtime.run``."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError("replicated collectives can only be called inside a step run by Runtime.run(step, ...)")
    return ctx


def swap(ctx: StepContext | None) -> StepContext | None:
    """Install ``ctx`` in the current context (this thread's or greenlet's) and return the previous one."""
    prev = _current.get()
    _current.set(ctx)
    return prev


def peek() -> StepContext | None:
    return _current.get()


#: :func:`peek` without the Python call (for hot paths): the bound ``ContextVar.get``.
peek_fast = _current.get
