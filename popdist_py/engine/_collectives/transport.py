"""MPI between instances: one header exchange per collective (carrying small payloads), bulk transfers.

Every collective starts with each instance sending every other instance a message that begins
with a 32-byte header ``[sequence, index in step, signature hash, status]``; for small
collectives the data rides in the same message ("eager"), so a small all-reduce costs a single
message exchange. These messages are persistent requests built once per collective plan
(:class:`HeaderChannel`); a message of unexpected size (a participant in another collective)
arrives whole or truncated, and either way its header reports the mismatch. Bulk data follows
as ``Isend``/``Irecv`` of numpy buffers. Every wait has a deadline (the collective timeout) and
polls MPI: a tight spin first (peers usually arrive within microseconds), then ``sched_yield``
(polite when instances oversubscribe the cores), then, for headers only, sleeps with back-off (a
peer computing for minutes must not cost a core); transfers never sleep, as MPI only makes
progress while polled.

Headers whose hashes differ fall back to :func:`popdist_py.agreement.agree` with the full
signature: every instance then raises :class:`.errors.InstancesDisagreeError` naming the values.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from popcontract.environment import COLLECTIVE_TIMEOUT
from popdist_py import agreement, deadline
from popdist_py.engine.errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InstancesDisagreeError,
    PeerAborted,
    PeerClosed,
)

log = logging.getLogger(__name__)

HDR_WORDS = 4
HDR_BYTES = 8 * HDR_WORDS
TAG_HEADER = 11
TAG_DATA = 12
TAG_GATHER = 13
TAG_RENEW = 14
STATUS_OK = 0
STATUS_ABORT = 1
STATUS_CLOSED = 2
#: What a difference in the ``step`` field of a collective's signature (see ``dispatch.CallLink``) means.
STEP_NOTE = ("each instance's count of Runtime.run calls: a step in which one instance called no collective, "
             "run there only or with its collectives skipped, pairs its next step with this one elsewhere")
_OK = np.int64(STATUS_OK).tobytes()
_CLOSED = np.int64(STATUS_CLOSED).tobytes()

#: Requests abandoned by failed collectives (each keeps its buffer alive). Never freed: MPI may
#: still read a send buffer after its request is freed, so they stay for the life of the process.
_ORPHANS: list[Any] = []


#: Busy-poll this long, then poll with sched_yield (gives the core to a runnable peer when
#: instances are oversubscribed) up to _YIELD, then sleep with back-off (deadline.poll). MPI's
#: own blocking waits spin forever; this keeps the latency of a spin for the usual short skews
#: between instances without burning a shared core while a slow instance computes for seconds.
_SPIN = 50e-6
_YIELD = 20e-3
_FIRST_SLEEP = 50e-6


#: The engine's waits: spin a little longer before yielding, and yield for longer before sleeping.
poll = partial(deadline.poll, spin=_SPIN, yield_for=_YIELD, first_sleep=_FIRST_SLEEP)


class HeaderChannel:
    """The header messages of one collective plan (or of the end of a step), as persistent requests.

    Starting prebuilt requests costs about a third of posting fresh ones and probing for the
    reply, which is most of a small all-reduce. Receives are posted with the size this instance
    expects: a peer in another collective sends another size, which arrives whole when shorter
    and truncated (an MPI error) when longer; either way its header names the mismatch.
    """

    __slots__ = ("recv_headers", "requests", "sendbufs", "sent_header")

    def __init__(self, comm: Any, peers: Sequence[int], sendbufs: Sequence[np.ndarray],
                 recvbufs: Sequence[np.ndarray]) -> None:
        self.sendbufs = list(sendbufs)  # the requests point into these (and the receive) buffers
        # byte views of the headers (they keep the receive buffers alive): comparing memoryviews
        # is the cheapest check per message
        self.sent_header = sendbufs[0].data[:HDR_BYTES]
        self.recv_headers = [b.data[:HDR_BYTES] for b in recvbufs]
        #: receives (one per peer, in peer order), then sends
        self.requests: list[Any] = [comm.Recv_init(b, p, TAG_HEADER) for p, b in zip(peers, recvbufs, strict=True)]
        self.requests += [comm.Send_init(b, p, TAG_HEADER) for p, b in zip(peers, sendbufs, strict=True)]

    def free(self) -> None:
        """Free the requests; one still active (a run interrupted mid-exchange) is left to MPI."""
        if not all(r.Test() for r in self.requests):
            # never freed: MPI may still touch the buffers, which the requests and this tuple keep alive
            _ORPHANS.append((self.requests, self.sendbufs, self.recv_headers))
        else:
            for r in self.requests:
                r.Free()
        self.requests = []


def _withdraw(request: Any) -> bool:
    """Whether a receive completed; if not, cancel it so a late peer never writes into its buffer."""
    try:
        if request.Test():
            return True
        request.Cancel()
        request.Wait()
    except Exception:  # pragma: no cover - best effort; the runtime is broken anyway
        pass
    return False


class Transport:
    """The MPI side of one Runtime: a private duplicate of the instances' communicator."""

    def __init__(self, comm: Any, describe_instance: Callable[[int], str], timeout: float) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm.Dup()
        #: where the instances meet to start afresh after a failed step (see ``renew``)
        self._recovery = comm.Dup()
        #: communicators left by renew (a stray message of a failed step may still arrive in one:
        #: freed, its context could be reused by a new communicator and the message match there)
        self._retired: list[Any] = []
        self.size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()
        self.peers = tuple(p for p in range(self.size) if p != self.rank)
        self.describe = describe_instance
        self.timeout = timeout
        self._Startall = MPI.Prequest.Startall
        self._Testall = MPI.Request.Testall
        self._channels: list[HeaderChannel] = []
        self._orphans: list[Any] = []  # sends left behind by a failed exchange or an abort notice
        # agree() keeps its own private duplicate of our communicator; create it now, while every
        # instance is constructing its Runtime, rather than in the middle of an error report.
        agreement.prepare(self.comm, timeout=timeout, what="Runtime()")

    # -- per-collective header (+ small payload) exchange ------------------------------------------
    def channel(self, sendbufs: Sequence[np.ndarray], recvbufs: Sequence[np.ndarray]) -> HeaderChannel:
        """Persistent requests for exchanging ``sendbufs[i]`` / ``recvbufs[i]`` with ``peers[i]``."""
        ch = HeaderChannel(self.comm, self.peers, sendbufs, recvbufs)
        self._channels.append(ch)
        return ch

    def exchange(
        self, channel: HeaderChannel, describe: Callable[[], tuple[str, tuple[Any, ...], Sequence[str]]]
    ) -> None:
        """Send each peer its message of ``channel``, receive its message, and check that the headers match.

        Every outgoing message starts with the same header (status OK); each peer's must equal it.

        Raises CollectiveTimeoutError naming instances that did not arrive, PeerAborted, or
        InstancesDisagreeError (on every instance, via ``agree``). ``describe()`` gives (what,
        signature, field names) for error messages; it is only called when something is wrong.
        """
        requests = channel.requests
        if not requests:
            raise CollectiveError(f"{describe()[0]}: this runtime's exchange timed out earlier and cannot be reused")
        Testall = self._Testall
        self._Startall(requests)
        mismatch = False
        try:
            # A short tight loop first (peers usually arrive within microseconds).
            spin_end = time.perf_counter() + _SPIN
            while not Testall(requests):
                if time.perf_counter() > spin_end:
                    if not poll(lambda: Testall(requests), time.monotonic() + self.timeout):
                        self._timed_out(channel, describe)
                    break
        except self.MPI.Exception:
            # A peer's message was longer than ours (another collective): MPI truncated it into
            # our buffer, and its header says what it was. Testall raises as soon as that request
            # completes, so let the others complete too before the channel can be started again.
            mismatch = True
            self._settle(channel, describe)
        expect = channel.sent_header
        for p, got in zip(self.peers, channel.recv_headers, strict=True):
            if got == expect:
                continue
            if got[24:32] == _CLOSED:
                raise PeerClosed(
                    f"{describe()[0]}: {self.describe(p)} closed its Runtime while this instance waited for it "
                    "(a step there ended without this collective)"
                )
            if got[24:32] != _OK:
                what = describe()[0]
                raise PeerAborted(
                    f"{what}: {self.describe(p)} abandoned its step (an exception was raised there; see its "
                    "output) while this instance waited for it"
                )
            mismatch = True
        if mismatch:
            what, signature, fields = describe()
            log.debug("%s: header mismatch, asking agree() for the details", what)
            try:
                agreement.agree(self.comm, what, signature, timeout=self.timeout, describe_rank=self.describe,
                                fields=fields, notes={"step": STEP_NOTE})
            except CollectiveMismatchError as exc:  # raised on every instance: they are still in step
                raise InstancesDisagreeError(str(exc)) from None
            raise InstancesDisagreeError(
                f"{what}: the instances disagree about this collective (signature hashes differ)"
            )

    def _settle(
        self, channel: HeaderChannel, describe: Callable[[], tuple[str, tuple[Any, ...], Sequence[str]]]
    ) -> None:
        """Wait, with the deadline, until each request has completed (truncated ones raise when tested)."""
        MPI = self.MPI

        def completed(request: Any) -> bool:
            try:
                done: bool = request.Test()
                return done
            except MPI.Exception:
                return True

        requests = channel.requests

        def all_completed() -> bool:  # every request is tested (completed) on every poll: no short cut
            done = [completed(r) for r in requests]
            return all(done)

        if not poll(all_completed, time.monotonic() + self.timeout):
            self._timed_out(channel, describe)

    def _timed_out(
        self, channel: HeaderChannel, describe: Callable[[], tuple[str, tuple[Any, ...], Sequence[str]]]
    ) -> None:
        """Some peers never sent their message: withdraw our receives and name those peers."""
        count = len(self.peers)
        missing = [p for p, r in zip(self.peers, channel.requests[:count], strict=True) if not _withdraw(r)]
        self._orphans.extend(channel.requests)
        channel.requests = []  # still active: never to be started again (the runtime is broken now)
        what = describe()[0]
        if not missing:
            raise CollectiveTimeoutError(
                f"{what}: sending to the other instances did not complete within {self.timeout:g} s"
            )
        names = ", ".join(self.describe(p) for p in missing)
        raise CollectiveTimeoutError(
            f"{what}: {names} did not arrive within {self.timeout:g} s "
            f"({count + 1 - len(missing)} of {count + 1} instances did); "
            f"set {COLLECTIVE_TIMEOUT} to wait longer"
        )

    # -- bulk transfers ------------------------------------------------------------------------------
    def transfer(
        self,
        recvs: Sequence[tuple[int, np.ndarray]],
        sends: Sequence[tuple[int, np.ndarray]],
        tag: int,
        describe: Callable[[], tuple[str, tuple[Any, ...], Sequence[str]]],
    ) -> None:
        """Post all receives, then all sends, and wait for everything (polling MPI without sleeping).

        Messages between a pair of instances are matched in posting order, so both sides must
        list them in the same order (the collective plans guarantee it). Every peer has passed
        the header exchange, so this normally completes at MPI speed; the deadline only catches
        a peer that gave up (timed out) after sending its header.
        """
        if not recvs and not sends:
            return
        MPI = self.MPI
        comm = self.comm
        rreqs = [comm.Irecv([a, MPI.BYTE], p, tag) for p, a in recvs]
        reqs = rreqs + [comm.Isend([a, MPI.BYTE], p, tag) for p, a in sends]
        if poll(lambda: MPI.Request.Testall(reqs), time.monotonic() + self.timeout, sleep=False):
            return
        late = sorted({p for (p, _), r in zip(recvs, rreqs, strict=True) if not r.Test()})
        for r in rreqs:  # a late peer must never write into our (soon user-visible) buffers
            try:
                if not r.Test():
                    r.Cancel()
                    r.Wait()
            except Exception:  # pragma: no cover - best effort; the runtime is broken anyway
                pass
        self._orphans.extend(reqs)
        names = ", ".join(self.describe(p) for p in late) or "the other instances"
        raise CollectiveTimeoutError(
            f"{describe()[0]}: the data exchange with {names} did not complete within {self.timeout:g} s "
            "(an instance gave up on this collective or stopped)"
        )

    def send_abort(self, seq: int, status: int = STATUS_ABORT) -> None:
        """Tell every peer that this instance abandoned its step (or, with ``STATUS_CLOSED``, that it
        will take part in no further collective), so none waits for the timeout. A peer that never
        looks again simply never receives it."""
        hdr = np.array([seq, -1, 0, status], dtype=np.int64).view(np.uint8)
        for p in self.peers:
            self._orphans.append(self.comm.Isend(hdr, p, TAG_HEADER))  # the request keeps hdr alive

    def farewell(self, seq: int, wait: float) -> bool:
        """Tell every peer this instance takes part in no further collective (a peer waiting in one
        raises :class:`PeerClosed` at once), then wait up to ``wait`` seconds for every peer's own
        farewell. True when all came: no message of this communicator is left unreceived, so it
        can be freed (MPI reuses a freed communicator's context, and a stray message would match a
        later runtime's receive)."""
        self.send_abort(seq, STATUS_CLOSED)
        if wait <= 0:
            return False
        MPI = self.MPI
        bufs = [np.zeros(HDR_BYTES, np.uint8) for _ in self.peers]
        reqs = [self.comm.Irecv([b, MPI.BYTE], p, TAG_HEADER) for p, b in zip(self.peers, bufs, strict=True)]
        try:
            arrived = poll(lambda: MPI.Request.Testall(reqs), time.monotonic() + wait)
        except MPI.Exception:  # a longer message: that peer is in a collective, not closing
            arrived = False
        if not arrived:
            for r in reqs:
                _withdraw(r)
            self._orphans.extend(reqs)
            log.debug("not every instance closed its runtime within %g s; its communicator is kept", wait)
            return False
        return all(b.data[24:32] == _CLOSED for b in bufs)

    def renew(self, why: str) -> None:
        """Meet every other instance after a failed step (each comes once it has seen the failure:
        its own exception, or an abort notice) and go on over a new communicator, where no message
        of the failed step can arrive; every channel must be made again. Raises PeerClosed for an
        instance that closed its runtime instead (its farewell, on the old communicator, is looked
        for meanwhile), CollectiveTimeoutError naming those that did not come; then this
        transport cannot be used."""
        what = f"bringing the instances back in step after a failed step ({why})"
        MPI = self.MPI
        token = np.zeros(1, np.int64)
        got = [np.zeros(1, np.int64) for _ in self.peers]
        recvs = [self._recovery.Irecv(g, p, TAG_RENEW) for g, p in zip(got, self.peers, strict=True)]
        self._orphans += [self._recovery.Isend(token, p, TAG_RENEW) for p in self.peers]
        closed: list[int] = []

        def met() -> bool:
            for p, r in zip(self.peers, recvs, strict=True):
                if not r.Test() and self._said_farewell(p):
                    closed.append(p)
            return bool(closed) or MPI.Request.Testall(recvs)

        # A peer waiting for data that never comes sees the failure only at its own timeout.
        arrived = poll(met, time.monotonic() + 2 * self.timeout)
        if closed or not arrived:
            missing = [p for p, r in zip(self.peers, recvs, strict=True) if not _withdraw(r)]
            self._orphans += recvs
            if closed:
                names = ", ".join(self.describe(p) for p in closed)
                raise PeerClosed(f"{what}: {names} closed its Runtime instead")
            names = ", ".join(self.describe(p) for p in missing)
            raise CollectiveTimeoutError(f"{what}: {names} did not come within {2 * self.timeout:g} s (twice the "
                                         f"collective timeout); set {COLLECTIVE_TIMEOUT} to wait longer")
        comm, request = self._recovery.Idup()
        deadline.wait(request, self._recovery, what, timeout=self.timeout, describe_rank=self.describe)
        self._free_channels()
        self._retired.append(self.comm)
        self.comm = comm
        agreement.prepare(self.comm, timeout=self.timeout, what=what)

    def _free_channels(self) -> None:
        """Free every header channel (inactive between collectives; one still active, of a failed
        exchange, is left to MPI)."""
        for ch in self._channels:
            ch.free()
        self._channels.clear()

    def _said_farewell(self, peer: int) -> bool:
        """Whether, among the messages ``peer`` left on this communicator (those of a failed step),
        is its farewell (see ``farewell``). Each is received here: the communicator is retired next."""
        MPI = self.MPI
        status = MPI.Status()
        while self.comm.Iprobe(peer, TAG_HEADER, status):
            buf = np.zeros(max(status.Get_count(MPI.BYTE), HDR_BYTES), np.uint8)
            self.comm.Recv([buf, MPI.BYTE], peer, TAG_HEADER)
            if buf.data[24:32] == _CLOSED:
                return True
        return False

    # -- host-side collectives for variables ----------------------------------------------------------
    def allgatherv(self, send: np.ndarray, counts: Sequence[int], recv: np.ndarray, what: str) -> None:
        """Gather ``counts[i]`` bytes from instance ``i`` into ``recv`` (instance order), with a deadline."""
        MPI = self.MPI
        displs = np.concatenate(([0], np.cumsum(counts[:-1]))).astype(np.int64).tolist()
        req = self.comm.Iallgatherv([send, MPI.BYTE], [recv, (list(counts), displs), MPI.BYTE])
        deadline.wait(req, self.comm, what, timeout=self.timeout, describe_rank=self.describe)

    def gatherv(self, send: np.ndarray, counts: Sequence[int], recv: np.ndarray | None, root: int, what: str) -> None:
        """Gather ``counts[i]`` bytes from instance ``i`` into ``recv`` on ``root`` only, with a deadline."""
        MPI = self.MPI
        if self.rank == root:
            assert recv is not None
            displs = np.concatenate(([0], np.cumsum(counts[:-1]))).astype(np.int64).tolist()
            req = self.comm.Igatherv([send, MPI.BYTE], [recv, (list(counts), displs), MPI.BYTE], root)
        else:
            req = self.comm.Igatherv([send, MPI.BYTE], None, root)
        deadline.wait(req, self.comm, what, timeout=self.timeout, describe_rank=self.describe)

    def bcast(self, buf: np.ndarray, root: int, what: str) -> None:
        """Broadcast ``buf`` (any dtype, same size everywhere) from ``root``, with a deadline."""
        assert buf.flags.c_contiguous, "broadcast buffers must be contiguous (the data lands in them)"
        req = self.comm.Ibcast([buf.reshape(-1).view(np.uint8), self.MPI.BYTE], root)
        deadline.wait(req, self.comm, what, timeout=self.timeout, describe_rank=self.describe)

    def bcast_bytes(self, data: bytes | None, root: int, what: str) -> bytes:
        """``root``'s ``data`` on every instance (length first, then the bytes)."""
        size = np.array([len(data) if self.rank == root and data is not None else 0], np.int64)
        self.bcast(size, root, what)
        buf = np.frombuffer(data, np.uint8).copy() if self.rank == root and data else np.zeros(int(size[0]), np.uint8)
        if size[0]:
            self.bcast(buf, root, what)
        return buf.tobytes()

    def agree(self, what: str, signature: tuple[Any, ...], fields: Sequence[str] | None = None) -> None:
        agreement.agree(self.comm, what, signature, timeout=self.timeout, describe_rank=self.describe, fields=fields)

    def close(self, free: bool) -> None:
        """Release the communicator (``free``: only when every instance is known to be in step)."""
        MPI = self.MPI
        if MPI.Is_finalized():
            return
        _ORPHANS.extend(r for r in self._orphans if not r.Test())
        self._orphans.clear()
        self._free_channels()
        if free:
            for comm in (self.comm, self._recovery):
                try:
                    comm.Free()
                except Exception:  # pragma: no cover
                    log.debug("could not free a runtime communicator", exc_info=True)
