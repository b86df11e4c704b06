"""Which instances the current code runs on: all of them, or a subset in ``execute_on_instances``.

Host collectives and ``synchronize()`` act over the current :class:`Scope`: the whole world by
default, or only the instances named by the innermost ``execute_on_instances`` call. The scope is
process-wide (all threads of the instance see it), like PopDist's default communicator.
Instances are always named by their index in the whole job, also inside a subset.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from popdist_py import agreement
from popdist_py.world import is_single_instance, world

T = TypeVar("T")

#: Tag of the communicator creation (MPI_Comm_create_group) among the members of a subset.
_GROUP_TAG = 0x5044


@dataclass(frozen=True)
class Scope:
    """A communicator and the job-wide instance index of each of its ranks (``comm`` is None
    in a one-instance job, which needs no MPI)."""

    comm: Any
    instances: tuple[int, ...]
    me: int  # this process's job-wide instance index

    @property
    def size(self) -> int:
        return len(self.instances)

    def describe(self, rank: int) -> str:
        return f"instance {self.instances[rank]}"

    def rank_of(self, instance: int) -> int:
        return self.instances.index(instance)

    def valid(self) -> str:
        if self.instances == tuple(range(len(self.instances))):
            return f"0..{len(self.instances) - 1}" if len(self.instances) > 1 else "0"
        return ", ".join(map(str, self.instances))


_stack: list[Scope] = []
_stack_lock = threading.Lock()
_groups: dict[tuple[int, tuple[int, ...]], Scope] = {}
_world_scope: Scope | None = None


def world_scope() -> Scope:
    """All instances (the one-instance scope needs no MPI and is not cached: MPI may start later)."""
    global _world_scope
    if _world_scope is not None:
        world()  # raises after finalize()
        return _world_scope
    if is_single_instance():
        return Scope(None, (0,), 0)
    comm = world()
    _world_scope = Scope(comm, tuple(range(comm.Get_size())), comm.Get_rank())
    return _world_scope


def current_scope() -> Scope:
    """The instances running the current code (innermost ``execute_on_instances``, else all)."""
    with _stack_lock:
        if _stack:
            return _stack[-1]
    return world_scope()


def _normalise(instances: int | Iterable[int], scope: Scope, nested: bool) -> tuple[int, ...]:
    if isinstance(instances, int) and not isinstance(instances, bool):
        items: list[Any] = [instances]
    elif isinstance(instances, (str, bytes)) or not isinstance(instances, Iterable):
        raise TypeError(
            f"execute_on_instances: instances must be a set of instance indices, got {type(instances).__name__} "
            f"{instances!r}"
        )
    else:
        items = list(instances)
    bad_type = [i for i in items if not isinstance(i, int) or isinstance(i, bool)]
    if bad_type:
        raise TypeError(f"execute_on_instances: instance indices must be integers, got {bad_type!r}")
    wanted = tuple(sorted({int(i) for i in items}))
    invalid = [i for i in wanted if i not in scope.instances]
    if invalid:
        where = (
            f"only instances {scope.valid()} run the enclosing execute_on_instances"
            if nested
            else f"valid instances are {scope.valid()}"
        )
        raise ValueError(f"execute_on_instances: invalid instance indices {invalid}: {where}")
    return wanted


def _subset(parent: Scope, wanted: tuple[int, ...], timeout: float | None) -> Scope:
    """The scope of ``wanted`` (members of ``parent``, which agreed on the set already).

    A proper subset gets its own communicator, created once, collectively over the members only.
    """
    if len(wanted) == parent.size:
        return parent
    key = (id(parent.comm), wanted)
    scope = _groups.get(key)
    if scope is None:
        ranks = [parent.rank_of(i) for i in wanted]
        group = parent.comm.Get_group().Incl(ranks)
        try:
            comm = parent.comm.Create_group(group, _GROUP_TAG)
        finally:
            group.Free()
        agreement.prepare(comm, timeout=timeout, what="execute_on_instances")
        scope = Scope(comm, wanted, parent.me)
        _groups[key] = scope
    return scope


def execute_on_instances(instances: int | Iterable[int], func: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """Run ``func(*args, **kwargs)`` only on ``instances``; return its result there, None elsewhere.

    Every instance of the enclosing scope (the whole job, or the enclosing
    ``execute_on_instances``' set) calls it: they first agree on the set, so a different set on
    some instance raises CollectiveMismatchError on every one of them, naming each instance's
    set, and an instance that never comes is named after the timeout; the communicator stays
    usable after a mismatch. Those not listed then return None. Inside ``func`` collectives and
    ``synchronize()`` involve only the listed instances. Nested
    calls work: the inner set must be part of the outer one. The sub-communicator is created
    once per set with ``MPI_Comm_create_group`` (collective over the members only) and reused.
    The agreement is bounded by ``POPDIST_COLLECTIVE_TIMEOUT`` (every keyword argument
    goes to ``func``). Do not call it concurrently from several threads of one instance.
    """
    with _stack_lock:
        nested = bool(_stack)
    parent = current_scope()
    wanted = _normalise(instances, parent, nested)
    if parent.comm is not None:
        # Over the whole enclosing scope, not only the listed instances: an instance that is not
        # in its own set may be in another instance's, and must say so rather than leave it waiting.
        agreement.agree(parent.comm, "execute_on_instances", (wanted,), describe_rank=parent.describe,
                        fields=("instance set",))
    if parent.me not in wanted:
        return None
    scope = parent if parent.comm is None else _subset(parent, wanted, None)
    with _stack_lock:
        _stack.append(scope)
    try:
        return func(*args, **kwargs)
    finally:
        with _stack_lock:
            _stack.pop()

