"""Replica groupings and CommGroups: PopXL's tables 13.1-13.3, formulas, validation, mapping."""

from __future__ import annotations

import itertools

import pytest

from popdist_py.engine import CommGroup, CommGroupType, ReplicaGrouping
from tests.engine_helpers import valid_groupings

pytestmark = pytest.mark.one_executor  # pure values: no Runtime


def brute_groups(n: int, s: int, g: int) -> list[list[int]]:
    """Groups by the definition: blocks of s*g replicas, within a block replicas r, r+s, ... together."""
    groups = []
    for block in range(0, n, s * g):
        for j in range(s):
            groups.append([block + j + k * s for k in range(g)])
    return groups


def test_table_13_1_consecutive_groups_of_four() -> None:
    rg = ReplicaGrouping.create(16, group_size=4)
    assert (rg.stride, rg.group_size, rg.num_groups) == (1, 4, 4)
    assert [list(m) for m in rg.groups] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_table_13_2_stride_four() -> None:
    rg = ReplicaGrouping.create(16, stride=4)
    assert (rg.stride, rg.group_size, rg.num_groups) == (4, 4, 4)
    assert [list(m) for m in rg.groups] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_table_13_3_every_replica_alone() -> None:
    rg = ReplicaGrouping.create(16, group_size=1)
    assert (rg.stride, rg.group_size, rg.num_groups) == (1, 1, 16)
    assert [list(m) for m in rg.groups] == [[r] for r in range(16)]


@pytest.mark.parametrize(
    "stride, group_size, assignment",
    [(1, 2, "00112233"), (2, 2, "01012323"), (2, 4, "01010101"), (4, 2, "01230123"), (1, 8, "00000000")],
)
def test_assignment_examples_n8(stride: int, group_size: int, assignment: str) -> None:
    rg = ReplicaGrouping.create(8, stride, group_size)
    assert rg.assignment == tuple(int(c) for c in assignment)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8, 12, 16])
def test_formulas_match_definition(n: int) -> None:
    for rg in valid_groupings(n):
        expect = brute_groups(n, rg.stride, rg.group_size)
        assert [list(m) for m in rg.groups] == expect
        for g, members in enumerate(expect):
            assert rg.first(g) == members[0]
            for k, r in enumerate(members):
                assert rg.group_of(r) == g
                assert rg.index_in_group(r) == k
                assert rg.member(g, k) == r


def test_default_group_size_and_forced_stride() -> None:
    assert ReplicaGrouping.create(8).group_size == 8
    assert ReplicaGrouping.create(8, stride=2).group_size == 4
    rg = ReplicaGrouping.create(8, stride=2, group_size=1)
    assert (rg.stride, rg.group_size) == (1, 1)
    assert rg == ReplicaGrouping.create(8, 1, 1)


@pytest.mark.parametrize(
    "n, stride, group_size, words",
    [
        (8, 0, None, ["stride=0 is invalid: it must be an integer >= 1"]),
        (8, -2, None, ["stride=-2 is invalid: it must be an integer >= 1"]),
        (8, 3, None, ["stride=3", "8"]),
        (8, 16, None, ["stride=16"]),
        (8, 1, 0, ["group_size=0 is invalid: it must be an integer >= 1"]),
        (8, 1, -1, ["group_size=-1 is invalid: it must be an integer >= 1"]),
        (0, 1, None, ["num_replicas=0 is invalid: it must be an integer >= 1"]),
        (8, 1, 9, ["group_size=9"]),
        (8, 1, 3, ["group_size=3", "8 replicas"]),
        (8, 2, 3, ["stride=2", "group_size=3", "[1, 2, 4]"]),
        (8, 4, 4, ["stride=4", "group_size=4"]),
        (6, 2, 2, ["stride=2", "group_size=2", "[1, 3]"]),
    ],
)
def test_invalid_values_are_named(n: int, stride: int, group_size: int | None, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        ReplicaGrouping.create(n, stride, group_size)
    for w in words:
        assert w in str(info.value)


def test_wrong_types() -> None:
    with pytest.raises(TypeError, match="stride"):
        ReplicaGrouping.create(8, 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="group_size"):
        ReplicaGrouping.create(8, 1, True)


@pytest.mark.parametrize(
    "n, s, g, ts, tg",
    [(16, 1, 4, 4, 4), (16, 4, 4, 1, 4), (8, 1, 2, 2, 4), (8, 4, 2, 1, 4), (8, 1, 8, 1, 1), (8, 1, 1, 1, 8)],
)
def test_transpose(n: int, s: int, g: int, ts: int, tg: int) -> None:
    rg = ReplicaGrouping.create(n, s, g)
    t = rg.transpose()
    assert (t.stride, t.group_size) == (ts, tg)


@pytest.mark.parametrize("n", [2, 4, 6, 8, 12, 16])
def test_transpose_is_orthogonal_and_an_involution(n: int) -> None:
    for rg in valid_groupings(n):
        if not (rg.stride == 1 or rg.stride * rg.group_size == n):
            with pytest.raises(ValueError, match="transpose"):
                rg.transpose()
            continue
        t = rg.transpose()
        assert t.transpose() == rg
        assert rg.group_size * t.group_size == n
        # Members of one group of rg are in pairwise different groups of t, and vice versa.
        for members in rg.groups:
            assert len({t.group_of(r) for r in members}) == len(members)
        for members in t.groups:
            assert len({rg.group_of(r) for r in members}) == len(members)


def test_from_assignment() -> None:
    for rg in valid_groupings(12):
        assert ReplicaGrouping.from_assignment(rg.assignment) == rg
    with pytest.raises(ValueError, match="constant-stride"):
        ReplicaGrouping.from_assignment([0, 1, 1, 0])


def test_comm_group_table_n16() -> None:
    n = 16
    all_ = CommGroup.all().to_replica_grouping(n)
    assert (all_.stride, all_.group_size) == (1, 16) and all_.groups == (tuple(range(16)),)
    cons = CommGroup.consecutive(4).to_replica_grouping(n)
    assert (cons.stride, cons.group_size) == (1, 4)
    assert [list(m) for m in cons.groups] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    orth = CommGroup.orthogonal(4).to_replica_grouping(n)
    assert (orth.stride, orth.group_size) == (4, 4)
    assert [list(m) for m in orth.groups] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    none = CommGroup.none().to_replica_grouping(n)
    assert (none.stride, none.group_size) == (1, 1)
    assert CommGroup(CommGroupType.Ungrouped) == CommGroup.none()


@pytest.mark.parametrize("n", [1, 2, 4, 6, 8, 16])
def test_comm_group_reverse_mapping(n: int) -> None:
    for rg in valid_groupings(n):
        g, s = rg.group_size, rg.stride
        convertible = g == 1 or g == n or s == n // g or s == 1
        if not convertible:
            with pytest.raises(ValueError, match="no CommGroup"):
                rg.to_comm_group()
            continue
        cg = rg.to_comm_group()
        assert cg.to_replica_grouping(n) == rg
        if g == 1:
            assert cg.type is CommGroupType.Ungrouped
        elif g == n:
            assert cg.type is CommGroupType.All
        elif s == 1:
            assert cg == CommGroup.consecutive(g)
        else:
            assert cg == CommGroup.orthogonal(g)


@pytest.mark.parametrize("make", [CommGroup.consecutive, CommGroup.orthogonal])
@pytest.mark.parametrize("size", [0, -3])
def test_comm_group_sizes_must_be_positive(make, size: int) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=rf"^replica_group_size={size} is invalid: it must be an integer >= 1$"):
        make(size)


@pytest.mark.parametrize("size", [2.0, True, "2", None])
def test_comm_group_sizes_must_be_integers(size: object) -> None:
    with pytest.raises(TypeError, match=r"^replica_group_size must be an integer, got "):
        CommGroup.consecutive(size)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^replica_group_size must be an integer, got "):
        CommGroup.orthogonal(size)  # type: ignore[arg-type]


def test_indices_are_checked() -> None:
    rg = ReplicaGrouping.create(8, 2, 2)
    with pytest.raises(ValueError, match=r"^replica=8 is outside the valid range \[0, 7\] for num_replicas=8$"):
        rg.group_of(8)
    with pytest.raises(ValueError, match=r"^replica=-1 is outside the valid range"):
        rg.index_in_group(-1)
    with pytest.raises(ValueError, match=r"^group=4 is outside the valid range \[0, 3\] for num_groups=4$"):
        rg.first(4)
    with pytest.raises(ValueError, match=r"^member index=2 is outside the valid range \[0, 1\] for group_size=2$"):
        rg.member(0, 2)
    with pytest.raises(TypeError, match="replica must be an integer"):
        rg.group_of(1.0)  # type: ignore[arg-type]


def test_comm_group_invalid_size() -> None:
    with pytest.raises(ValueError, match="replica_group_size=3"):
        CommGroup.consecutive(3).to_replica_grouping(8)
    with pytest.raises(ValueError, match="replica_group_size=16"):
        CommGroup.orthogonal(16).to_replica_grouping(8)


def test_groupings_are_values() -> None:
    a, b = ReplicaGrouping.create(8, 2, 2), ReplicaGrouping.create(8, 2, 2)
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert repr(a) == "ReplicaGrouping(num_replicas=8, stride=2, group_size=2, num_groups=4)"
    assert list(itertools.chain(*a.groups)) != list(range(8))
