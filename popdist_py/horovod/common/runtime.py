"""Horovod's background thread: ops negotiated by name, run in one order, in the background.

One thread per process owns every MPI call of the Horovod API. The caller's thread only queues
a :class:`Request` with its numpy arrays and gets a :class:`Handle`; the background thread sends
the requests to the coordinator (world rank 0, which keeps the
:class:`~popdist_py.horovod.common.negotiation.Table`), receives the responses in the
coordinator's order, and runs each one's data exchange (mpi4py's buffer calls, non-blocking,
polled against the collective deadline) on a private duplicate of the process set's
communicator, so Horovod's traffic never meets the program's own MPI messages. Handles complete
as their responses run, which is what lets ``poll`` say False while an op is under way.

Messages: a rank's requests go to the coordinator as one pickled list per cycle (tag
``_REQUESTS``), the coordinator's responses to each rank as one list (tag ``_RESPONSES``);
``_LEAVE`` says a rank shut down.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from popcontract import settings
from popcontract.environment import COLLECTIVE_TIMEOUT, HOROVOD_FUSION_THRESHOLD, HOROVOD_STALL_CHECK_TIME_SECONDS
from popdist_py.deadline import collective_timeout, poll
from popdist_py.horovod.common import negotiation as neg
from popdist_py.horovod.common.negotiation import Request, Response
from popdist_py.horovod.common.timeline import Timeline

log = logging.getLogger(__name__)

_REQUESTS, _RESPONSES, _LEAVE, _STOP, _BYE = 11, 12, 13, 14, 15
#: How long a stopping rank waits for its peers' answers (a rank that died cannot answer).
_LEAVE_WITHIN = 10.0
#: Waiting for a peer while ops are in flight: yield the core until this long has passed without
#: progress (an op's answer mostly comes within it, and a sleep would add tens of microseconds),
#: then sleep, doubling up to _MAX_SLEEP: longer spinning only burns the cores that the peers
#: (and, on a shared host, every other job) need to get there.
_YIELD = 5e-4
#: After any progress, yield this long before sleeping even with nothing in flight: a program's
#: next op often comes within a millisecond, and a sleeping thread takes tens of microseconds to wake.
_HOT = 2e-4
_FIRST_SLEEP = 20e-6
_MAX_SLEEP = 1e-3
#: A rank with nothing in flight wakes this often to see whether the coordinator left.
_IDLE_WAKE = 0.05
#: Horovod's stall warning: an op waiting this long for ranks that have not submitted it is named
#: (HOROVOD_STALL_CHECK_TIME_SECONDS); at POPDIST_COLLECTIVE_TIMEOUT it fails. Checked once a second.
_STALL_WARNING = 60.0
_STALL_CHECK_EVERY = 1.0
#: A data exchange is polled (yielding the core) this long before it sleeps between polls.
_DATA_YIELD = 0.05


class Handle:
    """One submitted op: done once its response ran (``outputs`` set) or failed (``error`` set)."""

    __slots__ = ("done", "error", "inputs", "outputs", "request", "value")

    def __init__(self, request: Request, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray] | None) -> None:
        self.request = request
        self.inputs = list(inputs)
        self.outputs: list[np.ndarray] = list(outputs) if outputs is not None else []
        self.error = ""
        self.value: Any = None
        self.done = threading.Event()

    def finish(self, error: str = "") -> None:
        self.error = error
        self.done.set()


def _np_op(op: str) -> Any:
    from mpi4py import MPI

    return {"sum": MPI.SUM, "average": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}[op]


def _work_dtype(dtype: np.dtype) -> np.dtype:
    """MPI has no float16: reduce it in float32 (rounded back once)."""
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def scale(buf: np.ndarray, factor: float) -> None:
    """Multiply in place; integers in float64, truncated toward zero, as Horovod does."""
    if factor == 1.0:
        return
    if buf.dtype.kind in "fc":
        np.multiply(buf, buf.dtype.type(factor), out=buf)
    else:
        np.copyto(buf, np.trunc(buf.astype(np.float64) * factor), casting="unsafe")


def finish_average(buf: np.ndarray, op: str, postscale: float, n: int) -> None:
    """Apply the postscale factor, then for Average divide by the set's size ``n`` (a true
    division: exact wherever the mean is representable; integers in float64, truncated)."""
    scale(buf, postscale)
    if op != "average" or n == 1:
        return
    if buf.dtype.kind in "fc":
        np.divide(buf, n, out=buf)
    else:
        np.copyto(buf, np.trunc(buf.astype(np.float64) / n), casting="unsafe")


class Runtime:
    """The background thread and the communicators of one ``init()``; collective to create."""

    def __init__(self, comm: Any, process_sets: Sequence[Sequence[int]] = ()) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.ctrl = comm.Dup()
        self.comms: dict[int, Any] = {0: comm.Dup()}
        self.sets: dict[int, tuple[int, ...]] = {0: tuple(range(self.size))}
        for set_id, ranks in enumerate(process_sets, start=1):
            self._create_set(set_id, tuple(ranks))
        threshold = settings.integer(HOROVOD_FUSION_THRESHOLD, neg.FUSION_THRESHOLD)
        self.table = neg.Table(self.size, self.sets, threshold) if self.rank == 0 else None
        self._lock = threading.Lock()
        self._queue: list[tuple[Request, Handle]] = []
        self._in_flight: dict[tuple[int, str], Handle] = {}
        self._wake = threading.Event()
        self._sends: list[Any] = []
        self._stopping = ""
        self._stop_began = 0.0
        self._bye = False
        self._left: set[int] = set()
        self._said_bye: set[int] = set()
        self._responses: list[Response] = []
        self._next_stall_check = 0.0
        self.dead = ""
        #: Rank 0's timeline while one is being written (hvd.start_timeline, HOROVOD_TIMELINE).
        self.timeline: Timeline | None = None
        self._timeout = collective_timeout()
        self._thread = threading.Thread(target=self._main, name="horovod-background", daemon=True)
        self._thread.start()

    # -- the caller's side -------------------------------------------------------------------
    def submit(self, request: Request, inputs: Sequence[np.ndarray] = (),
               outputs: Sequence[np.ndarray] | None = None) -> Handle:
        """Queue an op; raises ValueError when this rank already has one of that name in flight."""
        handle = Handle(request, inputs, outputs)
        key = (request.process_set, request.name)
        with self._lock:
            if self.dead or self._stopping:
                handle.finish(self.dead or self._stopping)
                return handle
            if key in self._in_flight and request.kind != neg.JOIN:
                raise ValueError(f"{request.kind}: an op named {request.name!r} is already in flight on rank "
                                 f"{self.rank}; names must be unique among the ops not yet synchronized")
            if request.kind != neg.JOIN:
                self._in_flight[key] = handle
            else:
                self._in_flight[(0, "\0join")] = handle
            self._queue.append((request, handle))
        if self.timeline is not None:
            self.timeline.negotiate(request.kind, request.name)
        self._wake.set()
        return handle

    def in_flight(self, process_set: int, name: str) -> bool:
        with self._lock:
            return (process_set, name) in self._in_flight

    def stop(self, reason: str = "Horovod has been shut down") -> None:
        """Stop the thread (see :meth:`_main`); then ops still in flight here fail with ``reason``."""
        with self._lock:
            if not self._stopping:
                self._stopping = reason
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # -- the background thread ---------------------------------------------------------------
    def _main(self) -> None:
        """Cycle until stopped, then leave so that every message sent is received.

        A rank that stops sends LEAVE and goes on running the responses it gets (ops it submitted
        that its peers will run) until the coordinator's BYE, the last message it sends that rank.
        The coordinator that stops fails every op not yet run, sends STOP to the ranks still
        there, and answers each LEAVE with BYE; it ends when every rank has left (or after
        ``_LEAVE_WITHIN`` s, for a rank that cannot answer)."""
        try:
            delay = 0.0
            idle_since = time.monotonic()
            while not self._done():
                if self._cycle():
                    delay = 0.0
                    idle_since = time.monotonic()
                    continue
                delay = self._wait(delay, idle_since)
            self._finish_sends()
            self._die(self._stopping)
        except BaseException as e:  # an MPI failure: every op in flight says so
            log.debug("Horovod's background thread failed", exc_info=True)
            self._die(f"Horovod's background thread on rank {self.rank} failed: {type(e).__name__}: {e}")

    def _done(self) -> bool:
        if not self._stopping:
            return False
        if self._stop_began == 0.0:
            self._stop_began = time.monotonic()
            self._begin_leaving()
        if time.monotonic() - self._stop_began > _LEAVE_WITHIN:
            log.debug("rank %d: leaving without every answer after %g s", self.rank, _LEAVE_WITHIN)
            return True
        if self.table is not None:
            return len(self._left) == self.size - 1
        return self._bye

    def _begin_leaving(self) -> None:
        if self.table is not None:
            self.table.close(f"rank 0 (Horovod's coordinator) shut down: {self._stopping}")
            for rank in range(1, self.size):
                if rank not in self._left:
                    self._sends.append(self.ctrl.isend(self._stopping, rank, _STOP))
        else:
            self._sends.append(self.ctrl.isend(self._stopping, 0, _LEAVE))

    def _finish_sends(self) -> None:
        sends = self._sends
        poll(lambda: self.MPI.Request.Testall(sends), time.monotonic() + 1.0, yield_for=0.0)

    def _wait(self, delay: float, idle_since: float) -> float:
        """Wait for something to do: a local submission wakes the thread at once; a peer's message
        is polled for, at once while this rank waits for an answer, with back-off when it is idle
        (the coordinator always listens; another rank with nothing in flight has nothing to hear
        but STOP, which can wait)."""
        waiting = bool(self._in_flight) or bool(self._stopping) or bool(self.table and self.table.pending)
        quiet = time.monotonic() - idle_since
        if (waiting and quiet < _YIELD) or quiet < _HOT:
            os.sched_yield()
            return 0.0
        if not waiting and self.rank != 0:
            self._wake.wait(_IDLE_WAKE)
            return 0.0
        delay = min(max(delay * 2, _FIRST_SLEEP), _MAX_SLEEP)
        self._wake.wait(delay)
        return delay

    def _cycle(self) -> bool:
        """One turn: send new requests, take responses (coordinate on rank 0), run them."""
        self._wake.clear()
        if self.timeline is not None:
            self.timeline.cycle()
        with self._lock:
            new, self._queue = self._queue, []
        progressed = bool(new)
        if self.table is not None:
            progressed = self._coordinate(new) or progressed
        else:
            if new:
                self._sends.append(self.ctrl.isend([r for r, _ in new], 0, _REQUESTS))
            status = self.MPI.Status()
            while (message := self.ctrl.improbe(0, self.MPI.ANY_TAG, status)) is not None:
                payload, tag = message.recv(), status.Get_tag()
                progressed = True
                if tag == _RESPONSES:
                    self._responses += payload
                elif tag == _STOP:
                    with self._lock:
                        self._stopping = self._stopping or f"rank 0 (Horovod's coordinator) shut down: {payload}"
                elif tag == _BYE:
                    self._bye = True
        if self._sends:
            self._sends = [s for s in self._sends if not s.Test()]
        while self._responses:
            self._run(self._responses.pop(0))
        return progressed

    def _coordinate(self, new: list[tuple[Request, Handle]]) -> bool:
        """Rank 0's turn: take every rank's requests and leaves, announce what is ready."""
        assert self.table is not None
        outboxes: dict[int, list[Response]] = {}
        progressed = False
        if new:
            self._responses += self.table.submit(0, [r for r, _ in new])
        status = self.MPI.Status()
        while (message := self.ctrl.improbe(self.MPI.ANY_SOURCE, self.MPI.ANY_TAG, status)) is not None:
            source, tag = status.Get_source(), status.Get_tag()
            payload = message.recv()
            progressed = True
            if tag == _LEAVE:
                self.table.leave(source, f"shut down ({payload})")
                self._left.add(source)
            else:
                for error in self.table.submit(source, payload):
                    outboxes.setdefault(source, []).append(error)
        now = time.monotonic()
        if now >= self._next_stall_check:
            self._next_stall_check = now + _STALL_CHECK_EVERY
            for line in self.table.stalled(settings.seconds(HOROVOD_STALL_CHECK_TIME_SECONDS, _STALL_WARNING), now):
                log.warning("popdist_py.horovod: %s", line)
            expired = self.table.expire(collective_timeout(), now, f"set {COLLECTIVE_TIMEOUT} to wait longer")
            for response in expired:
                for member in response.members:
                    if member == 0:
                        self._responses.append(response)
                    else:
                        outboxes.setdefault(member, []).append(response)
        for response in self.table.ready():
            for member in response.members:
                if member == 0:
                    self._responses.append(response)
                elif member not in self._left:
                    outboxes.setdefault(member, []).append(response)
        for member, batch in outboxes.items():
            if member not in self._left:
                self._sends.append(self.ctrl.isend(batch, member, _RESPONSES))
        for member in self._left - self._said_bye:
            self._sends.append(self.ctrl.isend(None, member, _BYE))
            self._said_bye.add(member)
        return progressed

    def _die(self, reason: str) -> None:
        with self._lock:
            self.dead = self.dead or reason
            handles = [h for _, h in self._queue] + list(self._in_flight.values())
            self._queue = []
            self._in_flight.clear()
        for handle in handles:
            if not handle.done.is_set():
                handle.finish(reason)

    # -- running a response ------------------------------------------------------------------
    def _take(self, response: Response, request: Request) -> Handle | None:
        with self._lock:
            if request.kind == neg.JOIN:
                return self._in_flight.pop((0, "\0join"), None)
            return self._in_flight.pop((response.process_set, request.name), None)

    def _run(self, response: Response) -> None:
        timeline = self.timeline
        if timeline is not None:
            for r in response.requests:
                timeline.start(r.kind, r.name)
        try:
            self._run_now(response)
        finally:
            if timeline is not None:
                for r in response.requests:
                    timeline.end(r.kind, r.name)

    def _run_now(self, response: Response) -> None:
        handles = [self._take(response, r) for r in response.requests]
        if response.error:
            for h in handles:
                if h is not None:
                    h.finish(response.error)
            return
        try:
            runner = _RUNNERS[response.kind]
            value = runner(self, response, handles)
        except Exception as e:
            log.debug("running %s failed", response.kind, exc_info=True)
            for h in handles:
                if h is not None:
                    h.finish(f"{response.kind} {', '.join(map(repr, response.names))}: {type(e).__name__}: {e}")
            return
        for h in handles:
            if h is not None:
                h.value = value
                h.finish()

    def _complete(self, what: str, request: Any) -> None:
        if not poll(request.Test, time.monotonic() + self._timeout, spin=20e-6, yield_for=_DATA_YIELD):
            raise TimeoutError(f"{what}: timed out after {self._timeout:g} s in its data exchange: a rank "
                               f"stopped responding")

    def _set_rank(self, response: Response) -> int:
        return response.members.index(self.rank)

    def _create_set(self, set_id: int, ranks: tuple[int, ...]) -> None:
        self.sets[set_id] = ranks
        if self.rank in ranks:
            group = self.comms[0].Get_group().Incl(list(ranks))
            self.comms[set_id] = self.comms[0].Create_group(group, tag=set_id)
            group.Free()

    def _allreduce(self, response: Response, handles: list[Handle | None]) -> None:
        comm = self.comms[response.process_set]
        first = response.requests[0]
        parts: list[tuple[np.ndarray, np.ndarray | None]] = []
        for request, handle in zip(response.requests, handles, strict=True):
            if handle is None:  # this rank has joined: it sends zeros
                for dtype, shape in zip(request.dtypes, request.shapes, strict=True):
                    parts.append((np.zeros(shape, _numpy_dtype(dtype)), None))
            else:
                parts.extend(zip(handle.inputs, handle.outputs, strict=True))
        work = _work_dtype(parts[0][0].dtype)
        total = sum(a.size for a, _ in parts)
        send: Any = self.MPI.IN_PLACE
        if len(parts) == 1 and work == parts[0][0].dtype and parts[0][1] is not None:
            src, single = parts[0]
            assert single is not None
            buf = single.reshape(-1) if single.flags.c_contiguous else np.empty(total, work)
            if np.may_share_memory(src, buf):
                pass  # in place
            elif first.prescale == 1.0 and src.flags.c_contiguous and comm.Get_size() > 1:
                send = src.reshape(-1)  # MPI reduces from it into buf: no copy of the whole input first
            else:
                np.copyto(buf, src.reshape(-1))
        else:
            buf = np.empty(total, work)
            at = 0
            for a, _ in parts:
                np.copyto(buf[at:at + a.size], a.reshape(-1), casting="unsafe")
                at += a.size
        if send is self.MPI.IN_PLACE:
            scale(buf, first.prescale)
        if comm.Get_size() > 1 and total:
            self._complete("allreduce", comm.Iallreduce(send, buf, op=_np_op(first.op)))
        finish_average(buf, first.op, first.postscale, comm.Get_size())
        at = 0
        for a, dest in parts:
            if dest is not None and not np.may_share_memory(dest, buf):
                np.copyto(dest, buf[at:at + a.size].reshape(dest.shape), casting="unsafe")
            at += a.size

    def _allgather(self, response: Response, handles: list[Handle | None]) -> None:
        comm = self.comms[response.process_set]
        (request,), (handle,) = response.requests, handles
        rows = [[c.shapes[i][0] if c is not None else 0 for c in response.contributions[0]]
                for i in range(len(request.shapes))]
        for i, (dtype, shape) in enumerate(zip(request.dtypes, request.shapes, strict=True)):
            np_dtype = _numpy_dtype(dtype)
            row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * np_dtype.itemsize
            out = np.empty((sum(rows[i]), *shape[1:]), np_dtype)
            send = handle.inputs[i] if handle is not None else np.empty((0, *shape[1:]), np_dtype)
            counts = [n * row_bytes for n in rows[i]]
            if comm.Get_size() > 1 and out.nbytes:
                displs = displacements(counts)
                self._complete("allgather", comm.Iallgatherv(
                    [np.ascontiguousarray(send), self.MPI.BYTE], [out, (counts, displs), self.MPI.BYTE]))
            elif out.nbytes:
                np.copyto(out, send)
            if handle is not None:
                handle.outputs.append(out)

    def _broadcast(self, response: Response, handles: list[Handle | None]) -> None:
        comm = self.comms[response.process_set]
        (request,), (handle,) = response.requests, handles
        for i, (dtype, shape) in enumerate(zip(request.dtypes, request.shapes, strict=True)):
            if handle is None:
                buf = np.empty(shape, _numpy_dtype(dtype))
            else:
                buf = handle.outputs[i]
                if not np.shares_memory(buf, handle.inputs[i]) and self.rank == request.root:
                    np.copyto(buf, handle.inputs[i])
            if comm.Get_size() > 1 and buf.nbytes:
                self._complete("broadcast", comm.Ibcast([buf.reshape(-1).view(np.uint8), self.MPI.BYTE],
                                                        root=response.members.index(request.root)))

    def _alltoall(self, response: Response, handles: list[Handle | None]) -> list[int]:
        comm = self.comms[response.process_set]
        handle = handles[0]
        assert handle is not None
        me = self._set_rank(response)
        contributions = response.contributions[0]
        sent = [list(c.splits) if c is not None else [] for c in contributions]
        received = [sent[j][me] for j in range(len(sent))]
        src = np.ascontiguousarray(handle.inputs[0])
        row_bytes = int(np.prod(src.shape[1:], dtype=np.int64)) * src.dtype.itemsize
        out = np.empty((sum(received), *src.shape[1:]), src.dtype)
        send_counts = [n * row_bytes for n in sent[me]]
        recv_counts = [n * row_bytes for n in received]
        if comm.Get_size() > 1:
            sdispl = displacements(send_counts)
            rdispl = displacements(recv_counts)
            self._complete("alltoall", comm.Ialltoallv([src, (send_counts, sdispl), self.MPI.BYTE],
                                                       [out, (recv_counts, rdispl), self.MPI.BYTE]))
        else:
            np.copyto(out, src)
        handle.outputs.append(out)
        return received

    def _reducescatter(self, response: Response, handles: list[Handle | None]) -> None:
        comm = self.comms[response.process_set]
        (request,), (handle,) = response.requests, handles
        assert handle is not None
        n = comm.Get_size()
        me = self._set_rank(response)
        for src in handle.inputs:
            rows = split_rows(src.shape[0], n)
            row = int(np.prod(src.shape[1:], dtype=np.int64))
            work = _work_dtype(src.dtype)
            buf = src.astype(work, copy=True).reshape(-1)
            scale(buf, request.prescale)
            out = np.empty((rows[me], *src.shape[1:]), work)
            if n > 1:
                self._complete("reducescatter", comm.Ireduce_scatter(
                    buf, out.reshape(-1), [r * row for r in rows], op=_np_op(request.op)))
            else:
                np.copyto(out.reshape(-1), buf)
            finish_average(out.reshape(-1), request.op, request.postscale, n)
            handle.outputs.append(out.astype(src.dtype, copy=False))

    def _barrier(self, response: Response, handles: list[Handle | None]) -> None:
        return None

    def _join(self, response: Response, handles: list[Handle | None]) -> int:
        return response.value

    def _add_set(self, response: Response, handles: list[Handle | None]) -> int:
        self._create_set(response.value, response.requests[0].ranks)
        return response.value

    def _remove_set(self, response: Response, handles: list[Handle | None]) -> int:
        set_id = response.value
        self.sets.pop(set_id, None)
        comm = self.comms.pop(set_id, None)
        if comm is not None:
            comm.Free()
        return set_id


def split_rows(rows: int, parts: int) -> list[int]:
    """Horovod's split of ``rows`` over ``parts`` ranks: equal shares, the first ranks one more."""
    return [rows // parts + (1 if i < rows % parts else 0) for i in range(parts)]


def displacements(counts: list[int]) -> list[int]:
    """Where each rank's part starts in a buffer of parts of ``counts`` bytes, one after another."""
    return [sum(counts[:i]) for i in range(len(counts))]


def _numpy_dtype(name: str) -> np.dtype:
    return np.dtype(np.int16) if name == "bfloat16" else np.dtype(name)


_RUNNERS: dict[str, Callable[[Runtime, Response, list[Handle | None]], Any]] = {
    neg.ALLREDUCE: Runtime._allreduce,
    neg.ALLGATHER: Runtime._allgather,
    neg.BROADCAST: Runtime._broadcast,
    neg.ALLTOALL: Runtime._alltoall,
    neg.REDUCESCATTER: Runtime._reducescatter,
    neg.BARRIER: Runtime._barrier,
    neg.JOIN: Runtime._join,
    neg.ADD_PROCESS_SET: Runtime._add_set,
    neg.REMOVE_PROCESS_SET: Runtime._remove_set,
}
