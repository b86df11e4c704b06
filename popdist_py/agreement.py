"""Agreement before a collective: every participant checks that all call the same collective alike.

Before a collective every participant calls :func:`agree` with a small signature (what, op, shape,
dtype...). Each rank sends its encoded signature to every other rank with non-blocking
point-to-point messages and polls them against a deadline (:mod:`popdist_py.deadline`), so

* differing signatures raise :class:`CollectiveMismatchError` on *every* rank (each one sees all
  signatures), naming the ranks and their values, instead of a hang or silently wrong data;
* a rank that never arrives is named by every waiting rank after the timeout
  (:class:`CollectiveTimeoutError`) instead of the job hanging forever.

Once every rank has passed :func:`agree`, the collective itself can be a fast blocking MPI call.
The messages travel on a private duplicate of the user's communicator (cached on it as an MPI
attribute), so they can never match the user's own messages. Calls on one communicator must be
made in the same order on every rank and not concurrently from several threads, as for any MPI
collective.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np

from popcontract.environment import COLLECTIVE_TIMEOUT
from popdist_py.deadline import Describe, collective_timeout, describe_instance, poll
from popdist_py.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError

#: Fixed size of one encoded signature: 4-byte length + pickle (or a digest when too long).
SLOT = 512
_TAG = 7
_TAG_SUBSET = 8


class _Checker:
    """Per-communicator state: the private duplicate and whether an earlier check broke it."""

    def __init__(self, comm: Any, request: Any) -> None:
        self.comm = comm
        self.request = request  # Idup still in flight
        self.broken: str | None = None


_keyval: int | None = None
_keyval_lock = threading.Lock()


def _free_checker(comm: Any, keyval: int, checker: _Checker) -> None:
    from mpi4py import MPI

    # A broken check communicator may still receive a late rank's message: it is never freed,
    # so that its context id cannot be reused by a new communicator that would match that message.
    try:
        if checker.request is None and checker.broken is None and not MPI.Is_finalized():
            checker.comm.Free()
    except Exception:  # the user's communicator is going away; nothing useful to report
        pass


def _checker(comm: Any, what: str, deadline: float, timeout: float) -> _Checker:
    """The private duplicate of ``comm``, created (collectively, with a deadline) on first use."""
    global _keyval
    from mpi4py import MPI

    with _keyval_lock:
        if _keyval is None:
            _keyval = MPI.Comm.Create_keyval(delete_fn=_free_checker)
        checker: _Checker | None = comm.Get_attr(_keyval)
        if checker is None:
            dup, request = comm.Idup()
            checker = _Checker(dup, request)
            comm.Set_attr(_keyval, checker)
    if checker.broken:
        raise CollectiveError(f"{what}: {checker.broken}; this communicator cannot be used for collectives any more")
    if checker.request is not None:
        request = checker.request
        if not poll(request.Test, deadline):
            checker.broken = "an earlier collective timed out while setting up popdist_py's check communicator"
            raise CollectiveTimeoutError(
                f"{what}: timed out after {timeout:g} s waiting for all {comm.Get_size()} participants to set up "
                "popdist_py's check communicator (some never arrived; call popdist_py.init() on every instance at "
                f"start-up to have late instances named); set {COLLECTIVE_TIMEOUT} to wait longer"
            )
        checker.request = None
    return checker


def mark_broken(comm: Any, why: str) -> None:
    """After an exchange on ``comm`` that could not complete (and cannot be cancelled): every later
    collective on it fails at once, saying ``why``, instead of meeting that exchange's leftovers."""
    if _keyval is None:
        return
    checker: _Checker | None = comm.Get_attr(_keyval)
    if checker is not None:
        checker.broken = why


def prepare(comm: Any, *, timeout: float | None = None, what: str = "init") -> None:
    """Create ``comm``'s private check communicator now (collective over ``comm``, with a deadline)."""
    if comm.Get_size() > 1:
        t = collective_timeout(timeout)
        _checker(comm, what, time.monotonic() + t, t)


def encode_signature(what: str, signature: Any) -> bytearray:
    try:
        payload = pickle.dumps((what, signature), protocol=5)
    except Exception:
        payload = b""
    if not payload or len(payload) > SLOT - 4:
        text = repr(signature)
        digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        keep = SLOT // 5
        short = text if len(text) <= 2 * keep else f"{text[:keep]}...{text[-keep:]}"
        payload = pickle.dumps((what[:keep], Opaque(f"{short} #{digest}")), protocol=5)
    buf = bytearray(SLOT)
    buf[:4] = len(payload).to_bytes(4, "little")
    buf[4 : 4 + len(payload)] = payload
    return buf


class Opaque(str):
    """A signature too long to send whole: the head and tail of its repr plus a digest."""

    def __repr__(self) -> str:
        return str(self)


def decode_signature(row: bytes) -> tuple[str, Any]:
    n = int.from_bytes(row[:4], "little")
    decoded: tuple[str, Any] = pickle.loads(row[4 : 4 + n])
    return decoded


def agree(
    comm: Any,
    what: str,
    signature: tuple[Any, ...] | Mapping[str, Any],
    *,
    timeout: float | None = None,
    describe_rank: Describe | None = None,
    fields: Sequence[str] | None = None,
    ranks: Sequence[int] | None = None,
    notes: Mapping[str, str] | None = None,
) -> None:
    """Check that every rank of ``comm`` calls ``what`` with an equal ``signature``.

    ``fields`` names the items of a tuple signature (a Mapping signature names them itself) so a
    mismatch says e.g. ``allreduce: shapes differ between instances: instance 0 (3, 4), instance
    1 (4,)``. ``describe_rank(rank)`` names a rank in messages (default ``instance {rank}``).
    ``ranks`` restricts the check to those ranks of ``comm`` (sorted, including the caller); only
    they take part. ``notes`` (by field name) explain a field when it differs. Raises
    CollectiveMismatchError on every participant, or
    CollectiveTimeoutError naming the ranks that did not arrive within ``timeout`` seconds (see
    :func:`collective_timeout`).
    """
    rank = comm.Get_rank()
    if ranks is None:
        size = comm.Get_size()
        if size == 1:
            return
        members: Sequence[int] = range(size)
        tag = _TAG
    else:
        members = sorted(ranks)
        if rank not in members:
            raise ValueError(f"{what}: rank {rank} calls agree() but is not one of ranks={list(members)}")
        size = len(members)
        if size == 1:
            return
        tag = _TAG_SUBSET
    t = collective_timeout(timeout)
    deadline = time.monotonic() + t
    describe = describe_rank or describe_instance
    checker = _checker(comm, what, deadline, t)
    mine = encode_signature(what, signature)
    me = members.index(rank)
    peers = [(i, p) for i, p in enumerate(members) if p != rank]
    received = np.empty((size, SLOT), dtype=np.uint8)
    received[me] = np.frombuffer(mine, dtype=np.uint8)
    ccomm = checker.comm
    recvs = [ccomm.Irecv(received[i], source=p, tag=tag) for i, p in peers]
    sends = [ccomm.Isend(mine, dest=p, tag=tag) for _, p in peers]
    requests = recvs + sends
    testall = sys.modules["mpi4py.MPI"].Request.Testall
    if not poll(partial(testall, requests), deadline):
        missing = [p for (_, p), r in zip(peers, recvs, strict=True) if not r.Test()]
        _abandon(recvs, sends)
        names = ", ".join(describe(p) for p in missing) or "(a participant)"
        checker.broken = f"an earlier collective ({what}) timed out waiting for {names}"
        raise CollectiveTimeoutError(
            f"{what}: timed out after {t:g} s waiting for {names}, which never arrived "
            f"({size - len(missing)} of {size} did); set {COLLECTIVE_TIMEOUT} to wait longer"
        )
    if received.tobytes() == bytes(mine) * size:
        return
    values = [decode_signature(received[i].tobytes()) for i in range(size)]
    if all(v == values[0] for v in values):  # equal values pickled differently (e.g. int vs np.int64)
        return
    raise CollectiveMismatchError(mismatch_message(what, members, values, describe, fields, notes))


def _abandon(recvs: list[Any], sends: list[Any]) -> None:
    """Cancel the receives a late rank never matched; leave its (eager) sends to complete."""
    for r in recvs:
        if not r.Test():
            try:
                r.Cancel()
                r.Wait()
            except Exception:  # best effort: the communicator is marked broken anyway
                pass
    for s in sends:
        if not s.Test():
            try:
                s.Free()
            except Exception:
                pass


def _fmt(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def _plural(field: str) -> str:
    return field if field.endswith("s") else field + "s"


def mismatch_message(
    what: str, ranks: Sequence[int], values: list[tuple[str, Any]], describe: Describe, fields: Sequence[str] | None,
    notes: Mapping[str, str] | None = None,
) -> str:
    positions = range(len(values))
    whats = [w for w, _ in values]
    if len(set(whats)) > 1:
        listing = ", ".join(f"{describe(ranks[i])} {whats[i]}" for i in positions)
        return f"{what}: instances are in different collectives: {listing}"
    sigs = [s for _, s in values]
    named: list[dict[str, Any]] | None = None
    if all(isinstance(s, Mapping) for s in sigs) and len({tuple(s) for s in sigs}) == 1:
        named = [dict(s) for s in sigs]
    elif fields and all(isinstance(s, tuple) and len(s) == len(fields) for s in sigs):
        named = [dict(zip(fields, s, strict=True)) for s in sigs]
    if named is not None:
        parts = []
        for field in named[0]:
            column = [n[field] for n in named]
            if any(v != column[0] for v in column):
                listing = ", ".join(f"{describe(ranks[i])} {_fmt(column[i])}" for i in positions)
                note = f" ({notes[field]})" if notes and field in notes else ""
                parts.append(f"{_plural(field)} differ between instances: {listing}{note}")
        if parts:
            return f"{what}: " + "; ".join(parts)
    listing = ", ".join(f"{describe(ranks[i])} {_fmt(sigs[i])}" for i in positions)
    return f"{what}: signatures differ between instances: {listing}"
