"""world(), agree() and wait() on real MPI ranks.

Run with ``mpiexec -n 2`` and ``-n 3``:
``timeout 120 .venv/bin/mpiexec -n 2 .venv/bin/python -m pytest -q --with-mpi tests/mpi/test_world.py``
Every rank runs the same tests in the same order; tests that make a rank late use a communicator
of their own, so that a timeout cannot leave the world's check state broken for later tests, and
hold the late ranks back by a message rank 0 sends once it has seen its timeout (not by a sleep).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import pytest

from popcontract.environment import COLLECTIVE_TIMEOUT
from popdist_py import agreement, deadline
from popdist_py.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError
from popdist_py.world import is_initialized, world

if TYPE_CHECKING:
    from mpi4py import MPI

FIELDS = ("op", "shape", "dtype")


@pytest.fixture(autouse=True)
def _short_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that fails on one rank only must not keep the others waiting for 600 s."""
    monkeypatch.setenv(COLLECTIVE_TIMEOUT, "30")


@pytest.fixture
def comm() -> Iterator[MPI.Intracomm]:
    """A fresh duplicate of the world (its own check state), freed after the test."""
    c = world().Dup()
    yield c
    c.Free()


#: Tag of the message with which rank 0 lets the late ranks go on (on the ``gate`` communicator).
GAVE_UP = 7


@pytest.fixture
def gate() -> Iterator[MPI.Intracomm]:
    """A second duplicate, for the messages that order a test's ranks, apart from the collective's own."""
    g = world().Dup()
    yield g
    g.Free()


def release_late_ranks(gate: MPI.Intracomm) -> None:
    """Rank 0 has seen what it waited for (call it in a ``finally``): the late ranks may go on."""
    for r in range(1, gate.Get_size()):
        gate.send(None, dest=r, tag=GAVE_UP)


def wait_until_released(gate: MPI.Intracomm, within: float = 60) -> None:
    """Wait for rank 0's GAVE_UP, polling with short sleeps so that rank 0 keeps a core while it waits."""
    end = time.monotonic() + within
    while not gate.Iprobe(source=0, tag=GAVE_UP):
        if time.monotonic() > end:
            pytest.fail(f"rank 0 did not let this rank go on within {within} s")
        time.sleep(0.001)
    gate.recv(source=0, tag=GAVE_UP)


def names(ranks: Iterable[int]) -> str:
    return ", ".join(f"instance {r}" for r in ranks)


@pytest.mark.mpi(min_size=2)
def test_world_is_comm_world_and_initialised() -> None:
    from mpi4py import MPI

    assert world() is MPI.COMM_WORLD
    assert world() is world()
    assert is_initialized()
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE


@pytest.mark.mpi(min_size=2)
def test_equal_signatures_agree() -> None:
    c = world()
    for _ in range(3):
        agreement.agree(c, "allreduce", ("sum", (3, 4), "float32"), fields=FIELDS)
    agreement.agree(c, "x", {"shape": (2,), "dtype": "int8"})
    agreement.agree(c, "x", (1, 2 if c.Get_rank() == 0 else np.int64(2)))  # equal values pickled differently
    agreement.agree(c, "x", ("y" * 2000,))  # longer than one message slot
    # agree() waits for every rank: rank 0 arrives late and writes its mark just before it arrives,
    # so a rank that passed agree() without rank 0's signature would not find that mark.
    shared = c.bcast(tempfile.mkdtemp(prefix="agree-") if c.Get_rank() == 0 else None, root=0)
    if c.Get_rank() == 0:
        time.sleep(0.3)  # not a timing check: it only makes an agree() that does not wait visible
    open(os.path.join(shared, f"arrived.{c.Get_rank()}"), "w").close()
    agreement.agree(c, "x", (1,))
    assert sorted(os.listdir(shared)) == sorted(f"arrived.{r}" for r in range(c.Get_size()))
    c.Barrier()  # every rank has looked before rank 0 removes the marks
    if c.Get_rank() == 0:
        for name in os.listdir(shared):
            os.remove(os.path.join(shared, name))
        os.rmdir(shared)


@pytest.mark.mpi(min_size=2)
def test_many_agrees_stay_in_step() -> None:
    # How fast agree() is belongs to `make bench` (the collectives section times the engine's
    # all-reduce, which agrees on every call), not to a test: here, 300 calls in a row, each with
    # its own signature, all agree, and a mismatch after them is still found and named.
    c = world()
    n = 300
    for i in range(n):
        agreement.agree(c, "allreduce", ("sum", (3, i), "float32"), fields=FIELDS)
    shape = (3, n) if c.Get_rank() == 0 else (3, n + 1)
    named = rf"allreduce: shapes differ between instances: instance 0 \(3, {n}\)"
    with pytest.raises(CollectiveMismatchError, match=named):
        agreement.agree(c, "allreduce", ("sum", shape, "float32"), fields=FIELDS)


@pytest.mark.mpi(min_size=2)
def test_mismatched_shapes_are_named_on_every_rank() -> None:
    c = world()
    n, rank = c.Get_size(), c.Get_rank()
    shapes = [(3, 4)] + [(4,)] * (n - 1)
    with pytest.raises(CollectiveMismatchError) as info:
        agreement.agree(c, "allreduce", ("sum", shapes[rank], "float32"), fields=FIELDS)
    listing = ", ".join(f"instance {r} {shapes[r]}" for r in range(n))
    assert str(info.value) == f"allreduce: shapes differ between instances: {listing}"


@pytest.mark.mpi(min_size=2)
def test_a_differing_field_is_explained_by_its_note() -> None:
    c = world()
    rank = c.Get_rank()
    with pytest.raises(CollectiveMismatchError) as info:
        agreement.agree(c, "allreduce", ("sum", (2 + min(rank, 1),), "float32"), fields=FIELDS,
                        notes={"shape": "steps: instance 0 at 3, instance 1 at 4", "op": "not this one"})
    listing = ", ".join(f"instance {r} ({2 + min(r, 1)},)" for r in range(c.Get_size()))
    assert str(info.value) == (f"allreduce: shapes differ between instances: {listing} (steps: instance 0 at 3, "
                               "instance 1 at 4)")  # the note of a field that does not differ is not said


@pytest.mark.mpi(min_size=2)
def test_a_communicator_marked_broken_fails_every_later_collective_at_once_saying_why() -> None:
    c = world().Dup()
    try:
        agreement.agree(c, "set-up", ())  # its check communicator exists now
        agreement.mark_broken(c, "an earlier collective timed out in its data exchange")
        start = time.monotonic()
        with pytest.raises(CollectiveError) as info:
            agreement.agree(c, "allreduce", ("sum",))
        assert time.monotonic() - start < 1  # at once, not at the collective's timeout
        assert str(info.value) == ("allreduce: an earlier collective timed out in its data exchange; this "
                                   "communicator cannot be used for collectives any more")
        fresh = world().Dup()
        agreement.mark_broken(fresh, "no check communicator yet: nothing to mark")
        agreement.agree(fresh, "still usable", ())
        fresh.Free()
    finally:
        c.Free()


@pytest.mark.mpi(min_size=2)
def test_every_differing_field_is_named_with_custom_rank_names() -> None:
    c = world()
    rank = c.Get_rank()
    op, dtype = ("sum", "float32") if rank == 0 else ("max", "int64")
    describe = lambda r: f"instance {r} (replicas {2 * r}-{2 * r + 1})"  # noqa: E731
    with pytest.raises(CollectiveMismatchError) as info:
        agreement.agree(c, "reduce", (op, (2,), dtype), fields=FIELDS, describe_rank=describe)
    message = str(info.value)
    assert message.startswith(
        "reduce: ops differ between instances: instance 0 (replicas 0-1) sum, instance 1 (replicas 2-3) max")
    assert ("; dtypes differ between instances: instance 0 (replicas 0-1) float32, instance 1 (replicas 2-3) int64"
            in message)
    assert "shapes" not in message


@pytest.mark.mpi(min_size=2)
def test_mapping_signature_names_its_fields() -> None:
    c = world()
    with pytest.raises(CollectiveMismatchError, match="x: groups differ between instances: instance 0 1, instance 1 2"):
        agreement.agree(c, "x", {"group": min(c.Get_rank() + 1, 2)})


@pytest.mark.mpi(min_size=2)
def test_unnamed_signatures_and_different_collectives() -> None:
    c = world()
    rank = c.Get_rank()
    signatures = r"signatures differ between instances: instance 0 \(1, 2\), instance 1 \(1, 3\)"
    with pytest.raises(CollectiveMismatchError, match=signatures):
        agreement.agree(c, "x", (1, 2 if rank == 0 else 3))
    different = "instances are in different collectives: instance 0 allreduce, instance 1 broadcast"
    with pytest.raises(CollectiveMismatchError, match=different):
        agreement.agree(c, "allreduce" if rank == 0 else "broadcast", ())
    head_tail_digest = r"instance 0 \('zz+\.\.\.z+0',\) #\w+, instance 1 \('zz+\.\.\.z+1',\) #"
    with pytest.raises(CollectiveMismatchError, match=head_tail_digest):
        agreement.agree(c, "x", ("z" * 600 + str(min(rank, 1)),))  # too long for a slot: head, tail, digest
    agreement.agree(c, "after errors the communicator still works", ())


@pytest.mark.mpi(min_size=2)
def test_only_the_mismatching_rank_differs_among_three_or_more() -> None:
    c = world()
    n, rank = c.Get_size(), c.Get_rank()
    dtypes = ["float32"] * (n - 1) + ["float64"]
    with pytest.raises(CollectiveMismatchError) as info:
        agreement.agree(c, "allgather", ((2,), dtypes[rank]), fields=("shape", "dtype"))
    assert f"instance {n - 1} float64" in str(info.value)


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_never_arrives_is_named(comm: MPI.Intracomm, gate: MPI.Intracomm) -> None:
    n, rank = comm.Get_size(), comm.Get_rank()
    agreement.agree(comm, "set-up", ())
    if rank == 0:
        start = time.monotonic()
        try:
            with pytest.raises(CollectiveTimeoutError) as info:
                agreement.agree(comm, "allreduce", ("sum",), timeout=0.3)
        finally:  # the late ranks come only now, whatever happened: never before rank 0 gave up
            release_late_ranks(gate)
        assert 0.3 <= time.monotonic() - start < 2
        assert str(info.value).startswith(
            f"allreduce: timed out after 0.3 s waiting for {names(range(1, n))}, which never arrived (1 of {n} did)"
        )
        with pytest.raises(CollectiveError, match="cannot be used for collectives any more"):
            agreement.agree(comm, "allreduce", ("sum",))
    else:
        wait_until_released(gate)
        agreement.agree(comm, "allreduce", ("sum",))  # rank 0's message is there: the late ranks pass
    world().Barrier()


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_never_sets_up_the_check_communicator_is_waited_for_within_the_timeout(
        comm: MPI.Intracomm, gate: MPI.Intracomm) -> None:
    """The private check communicator is made collectively on first use: rank 0 makes it alone and
    gives up after its timeout; the communicator is then marked unusable for collectives. On a pair
    of ranks, the smallest communicator that has one, whatever the size of the world."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    pair = comm.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
    if rank == 0:
        start = time.monotonic()
        try:
            with pytest.raises(CollectiveTimeoutError) as info:
                agreement.prepare(pair, timeout=0.3)
        finally:
            release_late_ranks(gate)
        assert 0.3 <= time.monotonic() - start < 2
        assert str(info.value) == (
            "init: timed out after 0.3 s waiting for all 2 participants to set up popdist_py's check "
            "communicator (some never arrived; call popdist_py.init() on every instance at start-up to have "
            f"late instances named); set {COLLECTIVE_TIMEOUT} to wait longer")
        with pytest.raises(CollectiveError) as later:
            agreement.agree(pair, "allreduce", ("sum",))
        assert str(later.value) == ("allreduce: an earlier collective timed out while setting up popdist_py's "
                                    "check communicator; this communicator cannot be used for collectives any more")
    else:
        wait_until_released(gate)
        if pair != MPI.COMM_NULL:
            agreement.prepare(pair)  # rank 0's part of the set-up is there: rank 1's completes
    world().Barrier()
    if pair != MPI.COMM_NULL:
        pair.Free()


#: The context ids MPICH has for communicators (its mask of 64 words of 32 bits, a few taken by the
#: world's own).
CONTEXT_IDS = 2048


@pytest.mark.mpi(min_size=2)
def test_check_communicators_are_freed_with_theirs() -> None:
    """Each communicator's private duplicate is freed with it: a program that makes and frees
    more communicators than MPICH has context ids (2,046 free in a new world) never runs out; one
    leaked per communicator would run out within the loop."""
    for _ in range(CONTEXT_IDS + 100):
        c = world().Dup()
        agreement.agree(c, "x", ())
        c.Free()


@pytest.mark.mpi(min_size=2)
def test_agree_among_some_ranks_only(comm: MPI.Intracomm) -> None:
    n, rank = comm.Get_size(), comm.Get_rank()
    ranks = [0, n - 1]
    if rank in ranks:
        agreement.agree(comm, "pair", ("ok",), ranks=ranks)
        with pytest.raises(CollectiveMismatchError, match=rf"instance 0 \('a',\), instance {n - 1} \('b',\)"):
            agreement.agree(comm, "pair", ("a" if rank == 0 else "b",), ranks=ranks)
    else:
        with pytest.raises(ValueError) as info:
            agreement.agree(comm, "pair", ("ok",), ranks=ranks)
        assert str(info.value) == f"pair: rank {rank} calls agree() but is not one of ranks=[0, {n - 1}]"
    agreement.agree(comm, "all again", ())


@pytest.mark.mpi(min_size=2)
def test_wait_bounds_a_nonblocking_collective(comm: MPI.Intracomm, gate: MPI.Intracomm) -> None:
    rank = comm.Get_rank()
    timed_out = r"ibarrier: timed out after 0.2 s waiting for the collective over instance 0, instance 1"
    if rank == 0:
        request = comm.Ibarrier()
        try:
            with pytest.raises(CollectiveTimeoutError, match=timed_out):
                deadline.wait(request, comm, "ibarrier", timeout=0.2)
        finally:  # the late ranks start their Ibarrier only now
            release_late_ranks(gate)
        deadline.wait(request, comm, "ibarrier")  # the late ranks come: it completes
    else:
        wait_until_released(gate)
        deadline.wait(comm.Ibarrier(), comm, "ibarrier")
    send = np.full(3, rank, dtype=np.int64)
    out = np.empty_like(send)
    deadline.wait([comm.Iallreduce(send, out)], comm, "iallreduce", timeout=5)
    assert out.tolist() == [sum(range(comm.Get_size()))] * 3
