"""Replica groupings over the global replicas, with PopXL's rules and PopART's CommGroup mapping.

A grouping splits the ``N`` global replicas into ``N / group_size`` equal groups whose members are
``stride`` apart: group ``g`` holds ``first(g) + k * stride`` for ``k < group_size``, with
``first(g) = (g // stride) * stride * group_size + g % stride``. PopXL also allows *irregular*
groupings (``from_assignments``): equal groups numbered by first appearance but without a constant
stride, e.g. ``[0, 1, 1, 0]``; they carry their assignment, and every method below answers from it.
A group's members are always in ascending replica order (the member order of every collective).
Groupings are pure values (no runtime state) so they can be compared, hashed and used as cache
keys by the collectives.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from popdist_py import validate


@dataclass(frozen=True)
class ReplicaGrouping:
    """``stride``/``group_size`` partition of ``num_replicas`` global replicas (PopXL's ReplicaGrouping).

    Build it with :meth:`create` or :meth:`from_assignments` (or ``Runtime.replica_grouping``),
    which validate the values; the constructor assumes they are valid. An irregular grouping has
    ``irregular`` set to its assignment and ``is_const`` False; its ``stride`` is 1 only so that
    records written as (stride, group_size) stay valid: it means nothing, use ``assignment``.
    """

    num_replicas: int
    stride: int = 1
    group_size: int = field(default=0)
    #: The group of every replica when the groups have no constant stride; None for (stride, group_size) ones.
    irregular: tuple[int, ...] | None = None

    @classmethod
    def create(cls, num_replicas: int, stride: int = 1, group_size: int | None = None) -> ReplicaGrouping:
        """Validate as PopXL does: 0 < stride <= N, N % stride == 0, 0 < group_size <= N,
        N % (stride * group_size) == 0; group_size defaults to N // stride; stride is forced to 1
        when group_size == 1 (every replica alone, whatever the stride)."""
        n = validate.count("num_replicas", num_replicas)
        stride = validate.count("stride", stride)
        if stride > n or n % stride:
            raise ValueError(
                f"stride={stride} is invalid for {n} replicas: it must be a divisor of the replication "
                f"factor, one of {_divisors(n)}"
            )
        if group_size is None:
            group_size = n // stride
        group_size = validate.count("group_size", group_size)
        if group_size > n:
            raise ValueError(f"group_size={group_size} is invalid for {n} replicas: it must be in 1..{n}")
        if n % (stride * group_size):
            valid = [g for g in _divisors(n) if n % (stride * g) == 0]
            raise ValueError(
                f"stride={stride} with group_size={group_size} does not divide {n} replicas: "
                f"stride * group_size must divide the replication factor (with stride={stride}, "
                f"group_size can be one of {valid})"
            )
        if group_size == 1:
            stride = 1
        return cls(n, stride, group_size)

    @classmethod
    def from_assignments(cls, assignment: Sequence[int]) -> ReplicaGrouping:
        """The grouping in which replica ``r`` is in group ``assignment[r]`` (PopXL's
        ``replica_grouping_from_assignments``): groups of equal size, numbered 0, 1, ... in order of
        first appearance. A constant-stride assignment gives the (stride, group_size) grouping,
        any other an irregular one."""
        a = _assignment_list(assignment)
        n = len(a)
        sizes = [0] * n
        seen = 0
        for r, g in enumerate(a):
            if g == seen:
                seen += 1
            elif not 0 <= g < seen:
                raise ValueError(
                    f"assignment {a}: replica {r} is in group {g}, but groups must be numbered 0, 1, ... in order "
                    f"of first appearance (the next new group here is {seen})"
                )
            sizes[g] += 1
        sizes = sizes[:seen]
        if len(set(sizes)) > 1:
            raise ValueError(f"assignment {a}: the groups differ in size ({dict(enumerate(sizes))}); "
                             "every group must have the same number of replicas")
        regular = _regular(a)
        if regular is not None:
            return regular
        return cls(n, 1, sizes[0], tuple(a))

    @classmethod
    def from_assignment(cls, assignment: Sequence[int]) -> ReplicaGrouping:
        """The constant-stride grouping whose ``assignment`` this is (the older, singular name: for
        irregular assignments use :meth:`from_assignments`); ValueError otherwise."""
        rg = cls.from_assignments(assignment)
        if rg.irregular is not None:
            raise ValueError(
                f"assignment {list(rg.irregular)} is not a constant-stride grouping; "
                "ReplicaGrouping.from_assignments (plural) builds irregular groupings"
            )
        return rg

    # -- derived values ------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return self.num_replicas // self.group_size

    @property
    def is_const(self) -> bool:
        """True for a (stride, group_size) grouping, False for an irregular one (PopXL's ``is_const``)."""
        return self.irregular is None

    @property
    def key(self) -> tuple[int, tuple[int, ...]] | tuple[int, int, int]:
        """What identifies the grouping (used in collective signatures)."""
        if self.irregular is not None:
            return (self.num_replicas, self.irregular)
        return (self.num_replicas, self.stride, self.group_size)

    @cached_property
    def assignment(self) -> tuple[int, ...]:
        """Group index of every global replica (PopXL's ``assignment``)."""
        if self.irregular is not None:
            return self.irregular
        return tuple(self.group_of(r) for r in range(self.num_replicas))

    @cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Members of every group, in member order."""
        if self.irregular is not None:
            out: list[list[int]] = [[] for _ in range(self.num_groups)]
            for r, g in enumerate(self.irregular):
                out[g].append(r)
            return tuple(tuple(m) for m in out)
        return tuple(self.members(g) for g in range(self.num_groups))

    @cached_property
    def _positions(self) -> tuple[int, ...]:
        """Irregular groupings: each replica's index in its group."""
        pos = [0] * self.num_replicas
        for members in self.groups:
            for k, r in enumerate(members):
                pos[r] = k
        return tuple(pos)

    def group_of(self, replica: int) -> int:
        s, g = self.stride, self.group_size
        self._check_replica(replica)
        if self.irregular is not None:
            return self.irregular[replica]
        return replica % s + s * (replica // (s * g))

    def index_in_group(self, replica: int) -> int:
        """Position of ``replica`` among its group's members (0 for the group's first replica)."""
        self._check_replica(replica)
        if self.irregular is not None:
            return self._positions[replica]
        return (replica - self.first(self.group_of(replica))) // self.stride

    def first(self, group: int) -> int:
        """The group's first (lowest) replica: the one ``one_per_group`` retrieval reads."""
        self._check_group(group)
        if self.irregular is not None:
            return self.groups[group][0]
        s, g = self.stride, self.group_size
        return (group // s) * s * g + group % s

    def member(self, group: int, k: int) -> int:
        validate.index("member index", k, "group_size", self.group_size)
        if self.irregular is not None:
            self._check_group(group)
            return self.groups[group][k]
        return self.first(group) + k * self.stride

    def members(self, group: int) -> tuple[int, ...]:
        if self.irregular is not None:
            self._check_group(group)
            return self.groups[group]
        f = self.first(group)
        return tuple(f + k * self.stride for k in range(self.group_size))

    def split(self, size: int) -> ReplicaGrouping:
        """The grouping whose groups are the runs of ``size`` consecutive members of this one's groups
        (``size`` divides the group size): a sharding domain. (stride, G) gives (stride, size)."""
        k = validate.count("size", size)
        if self.group_size % k:
            raise ValueError(f"size={k} must divide the group size {self.group_size} of {self}")
        if self.irregular is None:
            return ReplicaGrouping.create(self.num_replicas, self.stride if k > 1 else 1, k)
        sub = [0] * self.num_replicas
        for g, members in enumerate(self.groups):
            for j, r in enumerate(members):
                sub[r] = g * (self.group_size // k) + j // k
        return ReplicaGrouping.from_assignments(_renumber(sub))

    def transpose(self) -> ReplicaGrouping:
        """The orthogonal grouping: replicas that share a group here are in different groups there.

        Defined (as in PopART) when stride == 1 or stride * group_size == N; otherwise the result
        would not have a constant stride, which this engine does not represent for (stride,
        group_size) groupings. An irregular grouping's transpose groups the k-th members of all its
        groups together (PopXL's group-matrix transpose), irregular or not.
        """
        n, s, g = self.num_replicas, self.stride, self.group_size
        if self.irregular is not None:
            t = [0] * n
            for members in self.groups:
                for k, r in enumerate(members):
                    t[r] = k
            return ReplicaGrouping.from_assignments(_renumber(t))
        if s == 1:
            return ReplicaGrouping.create(n, g, n // g)
        if s * g == n:
            return ReplicaGrouping.create(n, 1, s)
        raise ValueError(
            f"cannot transpose {self}: the transpose of a grouping with stride={s} and group_size={g} "
            f"over {n} replicas is not a constant-stride grouping (needs stride == 1 or stride * group_size == {n})"
        )

    def to_comm_group(self) -> CommGroup:
        return CommGroup.from_replica_grouping(self)

    def describe(self) -> str:
        """The grouping's parameters as ``stride=.., group_size=..`` (irregular: its assignment)."""
        if self.irregular is not None:
            return f"assignment={list(self.irregular)}"
        return f"stride={self.stride}, group_size={self.group_size}"

    def _check_replica(self, replica: int) -> None:
        validate.index("replica", replica, "num_replicas", self.num_replicas)

    def _check_group(self, group: int) -> None:
        validate.index("group", group, "num_groups", self.num_groups)

    def __repr__(self) -> str:
        if self.irregular is not None:
            return f"ReplicaGrouping(num_replicas={self.num_replicas}, assignment={list(self.irregular)})"
        return (f"ReplicaGrouping(num_replicas={self.num_replicas}, stride={self.stride}, "
                f"group_size={self.group_size}, num_groups={self.num_groups})")

    def __str__(self) -> str:
        return repr(self)


def _assignment_list(assignment: Sequence[int]) -> list[int]:
    """``assignment`` as a non-empty list of ints; TypeError/ValueError naming it otherwise."""
    if isinstance(assignment, (str, bytes)) or not (isinstance(assignment, Sequence) or hasattr(assignment, "tolist")):
        raise TypeError(f"assignment must be a sequence of group indices (one per replica), got {assignment!r}")
    values = assignment.tolist() if hasattr(assignment, "tolist") else list(assignment)
    if not isinstance(values, list) or not values:
        raise ValueError(f"assignment {assignment!r} is empty: it needs one group index per replica")
    return [validate.integer("assignment entry", g) for g in values]


def _regular(a: list[int]) -> ReplicaGrouping | None:
    """The (stride, group_size) grouping with assignment ``a`` (a valid assignment), if there is one."""
    n = len(a)
    size = a.count(0)
    stride = next((r for r in range(1, n) if a[r] == 0), n) if size > 1 else 1
    try:
        rg = ReplicaGrouping.create(n, stride, size)
    except (TypeError, ValueError):
        return None
    return rg if rg.assignment == tuple(a) else None


def _renumber(groups: list[int]) -> list[int]:
    """Group labels renumbered 0, 1, ... in order of first appearance."""
    order: dict[int, int] = {}
    return [order.setdefault(g, len(order)) for g in groups]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class CommGroupType(enum.Enum):
    """PopART's CommGroupType. ``Ungrouped`` is PopART's "None" (every replica alone)."""

    All = "All"
    Consecutive = "Consecutive"
    Orthogonal = "Orthogonal"
    Ungrouped = "Ungrouped"


@dataclass(frozen=True)
class CommGroup:
    """PopART-style communication group: a type and a replica group size (ignored for All/Ungrouped).

    Maps onto a :class:`ReplicaGrouping` once the replication factor is known (reference 3.4):
    All -> (1, N); Consecutive(k) -> (1, k); Orthogonal(k) -> (N / k, k); Ungrouped -> (1, 1).
    """

    type: CommGroupType = CommGroupType.All
    replica_group_size: int = 0

    @classmethod
    def all(cls) -> CommGroup:
        return cls(CommGroupType.All, 0)

    @classmethod
    def consecutive(cls, size: int) -> CommGroup:
        return cls(CommGroupType.Consecutive, validate.count("replica_group_size", size))

    @classmethod
    def orthogonal(cls, size: int) -> CommGroup:
        return cls(CommGroupType.Orthogonal, validate.count("replica_group_size", size))

    @classmethod
    def none(cls) -> CommGroup:
        return cls(CommGroupType.Ungrouped, 0)

    ungrouped = none

    def to_replica_grouping(self, num_replicas: int) -> ReplicaGrouping:
        n = num_replicas
        t, k = self.type, self.replica_group_size
        if t is CommGroupType.All:
            return ReplicaGrouping.create(n, 1, n)
        if t is CommGroupType.Ungrouped:
            return ReplicaGrouping.create(n, 1, 1)
        if not 0 < k <= n or n % k:
            raise ValueError(
                f"{self}: replica_group_size={k} must divide the replication factor {n} "
                f"(one of {_divisors(n)})"
            )
        if t is CommGroupType.Consecutive:
            return ReplicaGrouping.create(n, 1, k)
        return ReplicaGrouping.create(n, n // k, k)

    @classmethod
    def from_replica_grouping(cls, rg: ReplicaGrouping) -> CommGroup:
        """Reverse mapping: G == 1 -> Ungrouped, G == N -> All, stride == N / G -> Orthogonal(G),
        stride == 1 -> Consecutive(G); anything else has no CommGroup (ValueError)."""
        n, s, g = rg.num_replicas, rg.stride, rg.group_size
        if rg.irregular is not None:
            raise ValueError(f"{rg} has no CommGroup equivalent: it is irregular (no constant stride)")
        if g == 1:
            return cls.none()
        if g == n:
            return cls.all()
        if s == n // g:
            return cls.orthogonal(g)
        if s == 1:
            return cls.consecutive(g)
        raise ValueError(
            f"{rg} has no CommGroup equivalent: CommGroups are All, Ungrouped, Consecutive (stride 1) "
            f"or Orthogonal (stride * group_size == {n})"
        )

    def __repr__(self) -> str:
        if self.type in (CommGroupType.All, CommGroupType.Ungrouped):
            return f"CommGroup({self.type.name})"
        return f"CommGroup({self.type.name}, {self.replica_group_size})"


#: What a collective or a variable takes as its group: a grouping, a CommGroup, or None (all replicas).
Group = ReplicaGrouping | CommGroup | None


def replica_grouping_of(group: Group, num_replicas: int) -> ReplicaGrouping:
    """``group`` as a grouping of ``num_replicas`` replicas (None: one group of all of them).

    ValueError when a ReplicaGrouping is for another number of replicas or a CommGroup does not
    fit it, TypeError for anything else.
    """
    if group is None:
        return ReplicaGrouping.create(num_replicas)
    if isinstance(group, ReplicaGrouping):
        if group.num_replicas != num_replicas:
            raise ValueError(
                f"group {group} is for {group.num_replicas} replicas but this runtime has "
                f"replication_factor={num_replicas}"
            )
        return group
    if isinstance(group, CommGroup):
        return group.to_replica_grouping(num_replicas)
    raise TypeError(f"group must be a ReplicaGrouping, a CommGroup or None, got {group!r}")
