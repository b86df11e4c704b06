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
    """The scope of ``wanted`` (members of ``parent``), after the members agreed on the set.

    A proper subset gets its own communicator, created once, collectively over the members only.
    """
    ranks = [parent.rank_of(i) for i in wanted]
    what = "execute_on_instances"
    agreement.agree(parent.comm, what, (wanted,), timeout=timeout, describe_rank=parent.describe,
                    fields=("instance set",), ranks=ranks)
    if len(wanted) == parent.size:
        return parent
    key = (id(parent.comm), wanted)
    scope = _groups.get(key)
    if scope is None:
        group = parent.comm.Get_group().Incl(ranks)
        try:
            comm = parent.comm.Create_group(group, _GROUP_TAG)
        finally:
            group.Free()
        agreement.prepare(comm, timeout=timeout, what=what)
        scope = Scope(comm, wanted, parent.me)
        _groups[key] = scope
    return scope


def execute_on_instances(instances: int | Iterable[int], func: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """Run ``func(*args, **kwargs)`` only on ``instances``; return its result there, None elsewhere.

    Every instance calls it (those not listed return at once, without communicating). Inside
    ``func`` collectives and ``synchronize()`` involve only the listed instances, which
    agree first (a different set, or a member that never comes, is an error naming them). Nested
    calls work: the inner set must be part of the outer one. The sub-communicator is created
    once per set with ``MPI_Comm_create_group`` (collective over the members only) and reused.
    The members' agreement is bounded by ``POPDIST_COLLECTIVE_TIMEOUT`` (every keyword argument
    goes to ``func``). Do not call it concurrently from several threads of one instance.
    """
    with _stack_lock:
        nested = bool(_stack)
    parent = current_scope()
    wanted = _normalise(instances, parent, nested)
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

