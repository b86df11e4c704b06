"""Pipelined execution of one replica's stages over its devices (PopART's pipelining).

A :class:`Pipeline` is the model a :class:`~popdist_py.engine.Trainer` trains: given it in place
of ``loss_and_grads``, the trainer hands it a batch's ``accumulation_factor`` micro-batches, and
each stage's device runs its forwards and backwards in the schedule's order
(:mod:`.schedule`: 1F1B by default, or GPipe), passing activations forward and their gradients
back between the devices' threads; each stage keeps what its backward needs per micro-batch in
flight. The pipeline is flushed at the end of the batch, then the trainer reduces the gradients
and updates the weights as without pipelining. Each stage's gradients are accumulated in
micro-batch order, as without pipelining, so the weights are bitwise those of the same stages
run one after the other (:meth:`Pipeline.sequential`, "the same model on one device").

A stage that raises ends the step: the other devices of its replica stop at their next wait, and
the replica raises :class:`PipelineStageError` naming replica, stage, forward or backward and
micro-batch; the engine then ends the step on every replica, as for any failing step.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from popcontract import settings
from popdist_py import validate
from popdist_py.engine.errors import PipelineStageError, StepAborted
from popdist_py.engine.pipeline import sync
from popdist_py.engine.pipeline.devices import Devices
from popdist_py.engine.pipeline.schedule import BACKWARD, FORWARD, ONE_F_ONE_B, SCHEDULES, Op, device_order, in_flight
from popdist_py.engine.pipeline.stages import Stage, check_stages
from popdist_py.engine.pipeline.stash import Stash
from popdist_py.engine.pipeline.sync import SINGLE_PIPELINE, Exchange
from popdist_py.engine.pipeline.trace import Event, write_chrome_trace

#: The device index of a replica's host thread (the feed) in events and exchange records.
HOST = -1
#: What a device's queue holds when its replica's step has failed elsewhere.
_ABORT = object()


class _Stopped(Exception):
    """A device stopped because another device of its replica failed."""


class Pipeline:
    """``stages`` (:class:`~.stages.Stage`) on ``devices_per_replica`` devices, run in
    ``schedule`` order ("1f1b" or "gpipe"). ``devices_per_replica`` defaults to the job's
    ``--ipus-per-replica`` (``popdist_py.getNumIpusPerReplica()``) under poprun, else the number
    of stages."""

    def __init__(self, stages: Sequence[Stage], devices_per_replica: int | None = None,
                 schedule: str = ONE_F_ONE_B, sync_pattern: str = SINGLE_PIPELINE,
                 feed: Callable[..., tuple[Any, ...]] | None = None) -> None:
        if devices_per_replica is None:
            devices_per_replica = _job_devices() or len(stages)
        self.devices_per_replica = validate.count("devices_per_replica", devices_per_replica)
        self.stages = check_stages(stages, self.devices_per_replica)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
        self.schedule = schedule
        self.sync_pattern = sync.sync_pattern(sync_pattern)
        if feed is not None and not callable(feed):
            raise TypeError(f"feed must be callable, (*micro_batch) -> micro_batch, got {feed!r}")
        #: the host's data feed, run on the replica's host thread (see :mod:`.sync`): (*micro_batch) -> micro_batch
        self.feed = feed
        self.weights = tuple(w for stage in self.stages for w in stage.weights)
        self._devices: Devices | None = None
        self._stashes: dict[tuple[int, int], Stash] = {}
        self._replicas_meet = False
        self._runs: dict[int, int] = {}  # runs so far, per local replica: which step's meeting to join
        self._meetings: dict[Any, sync.Meeting] = {}
        self._lock = threading.Lock()
        #: the last step's events of each local replica (see :meth:`write_trace`)
        self.events: dict[int, list[Event]] = {}
        #: the last step's host exchanges of each local replica, in the order they completed
        self.exchanges: dict[int, list[ExchangeRecord]] = {}

    # -------------------------------------------------------------------------------- set-up
    def start(self, local_replicas: int, stash_off_chip: bool = False, stash_min_elements: int = 0,
              replicas_meet: bool = False) -> None:
        """Make the device workers and stashes for ``local_replicas`` replicas (the trainer calls
        it, with the activation tensor location settings: stashes off chip or not).
        ``replicas_meet``: the replicas run at once (threads), so their devices meet at host
        exchanges together; otherwise each replica's devices meet alone."""
        with self._lock:
            self._replicas_meet = replicas_meet and local_replicas > 1
            self._runs = {}
            self._meetings = {}
            if self._devices is None or self._devices.replicas != local_replicas:
                if self._devices is not None:
                    self._devices.close()
                self._devices = Devices(local_replicas, self.devices_per_replica)
            self._stashes = {(i, s): Stash(stash_off_chip, stash_min_elements)
                             for i in range(local_replicas) for s in range(len(self.stages))}

    def stash(self, local: int, stage: int) -> Stash:
        """The stash of ``stage`` on local replica ``local``'s device."""
        return self._stashes[local, stage]

    @property
    def pinned(self) -> bool:
        """Whether every device worker has a core of its own (CPU affinity)."""
        return self._devices is not None and self._devices.pinned

    def close(self) -> None:
        """Stop the device workers. Idempotent."""
        with self._lock:
            if self._devices is not None:
                self._devices.close()
                self._devices = None

    def timetable(self, micro_batches: int) -> list[list[Op | Exchange]]:
        """Each stage's ops and host exchanges in its device's order."""
        return sync.with_exchanges(self.orders(micro_batches), self.sync_pattern)

    def orders(self, micro_batches: int) -> list[list[Op]]:
        """Each stage's ops in its device's order."""
        K = len(self.stages)
        return [device_order(self.schedule, s, K, micro_batches, stage.backward is not None)
                for s, stage in enumerate(self.stages)]

    def stashed(self, micro_batches: int) -> list[int]:
        """The most micro-batches each stage keeps stashed at once."""
        return [in_flight(order) for order in self.orders(micro_batches)]

    # -------------------------------------------------------------------------------- running
    def sequential(self, params: dict[str, Any], *micro_batch: Any) -> tuple[Any, dict[str, Any]]:
        """The stages one after the other on the calling thread, as a ``loss_and_grads``: the
        same model without pipelining (every forward, then every backward in reverse)."""
        carry: Any = None
        saved = []
        for stage in self.stages:
            carry, keep = stage.forward(params, carry, *micro_batch)
            saved.append(keep)
        loss = carry
        grad: Any = None
        grads: dict[str, Any] = {}
        for stage, keep in zip(reversed(self.stages), reversed(saved), strict=True):
            if stage.backward is None:
                break
            grad, mine = stage.backward(params, keep, grad)
            grads.update({w: mine[w] for w in stage.weights})
        return loss, grads

    def update_order(self, micro_batches: int) -> list[tuple[int, int]]:
        """(stage, micro-batch) of every backward in one global order (the simulated timeline's):
        the order in which a continuous pipeline's updates run, the same on every replica."""
        orders = self.orders(micro_batches)
        start, _ = sync.timeline(orders)
        backwards = [op for order in orders for op in order if op.kind == BACKWARD]
        return [(op.stage, op.micro_batch) for op in sorted(backwards, key=lambda op: (start[op], op.stage))]

    def run(self, local: int, replica: int, params: dict[str, Any], micro_batches: Sequence[tuple[Any, ...]],
            on_grads: Callable[[str, Any], None],
            update: Callable[[int, int], dict[str, Any]] | None = None) -> list[Any]:
        """One batch through the pipeline on local replica ``local`` (global index ``replica``):
        the loss of each micro-batch, in order. ``on_grads(weight, grad)`` is called on the
        stage's device, for each micro-batch in order.

        ``update(stage, micro_batch) -> params``: continuous pipelining (no flush between
        micro-batches). After each backward the stage's device waits while ``update`` runs on the
        calling thread (collectives allowed there), in :meth:`update_order`, and then computes
        with the params it returns: later forwards see the new weights (stale weights)."""
        devices = self._devices
        if devices is None:
            raise RuntimeError("Pipeline.run before start(local_replicas): give the pipeline to a Trainer")
        run = _Run(self, local, replica, params, micro_batches, on_grads, update)
        futures = [devices.submit(local, stage.device, functools.partial(run.device_loop, s, items))
                   for s, (stage, items) in enumerate(zip(self.stages, run.timetable, strict=True))]
        if self.feed is not None:
            futures.append(devices.submit(local, HOST, run.host_loop))
        errors: list[BaseException] = []
        if update is not None:
            self._serve_updates(update, run.M, run.requests, run.released, run.stop_all, errors)
        stopped = False
        for f in futures:
            try:
                f.result()
            except _Stopped:
                stopped = True
            except BaseException as e:
                errors.append(e)
        self._leave(run.key, run.meeting)
        self.events[local] = run.events
        self.exchanges[local] = sorted(run.records, key=lambda r: r.done)
        if errors:
            raise errors[0]
        if stopped:  # another replica's stage failed and broke the meetings
            raise StepAborted(f"replica {replica}: the pipeline stopped because another replica's stage failed")
        return run.losses

    def _meeting(self, local: int, plan: list[list[Op | Exchange]], host_inside: bool) -> tuple[Any, sync.Meeting]:
        """This run's meeting: shared by every local replica's run of the same step when they run at
        once, else this replica's own."""
        exchanges = {(x.kind, x.group) for items in plan for x in items if isinstance(x, Exchange)}
        with self._lock:
            n = self._runs[local] = self._runs.get(local, 0) + 1
            # single_pipeline: every device exchanges on its own, so no replica waits for another
            shared = self._replicas_meet and self.sync_pattern != sync.SINGLE_PIPELINE
            key: Any = n if shared else (local, n)
            meeting = self._meetings.get(key)
            if meeting is None:
                replicas = self._devices.replicas if shared and self._devices is not None else 1
                meeting = self._meetings[key] = sync.Meeting(exchanges, replicas, host_inside)
        return key, meeting

    def _leave(self, key: Any, meeting: sync.Meeting) -> None:
        with self._lock:
            meeting.running -= 1
            if meeting.running == 0:
                self._meetings.pop(key, None)

    def _serve_updates(self, update: Callable[[int, int], dict[str, Any]], micro_batches: int,
                       requests: queue.SimpleQueue[Any], released: list[queue.SimpleQueue[Any]],
                       stop_all: Callable[[], None], errors: list[BaseException]) -> None:
        """Run the stages' updates on this thread in :meth:`update_order` as their backwards finish."""
        arrived: set[tuple[int, int]] = set()
        for s, m in self.update_order(micro_batches):
            while (s, m) not in arrived:
                request = requests.get()
                if request is _ABORT:
                    return
                arrived.add(request)
            try:
                new = update(s, m)
            except BaseException as e:
                errors.append(e)
                stop_all()
                return
            released[s].put(new)

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """The last step's timeline of this process's replicas as Chrome trace-event JSON."""
        write_chrome_trace([e for events in self.events.values() for e in events], path)


class ExchangeRecord(NamedTuple):
    """A host exchange as it ran: the devices it waited for, each with the ticket of its arrival,
    and the ticket of its completion (tickets order events across the devices that meet)."""

    kind: str
    micro_batch: int
    #: (replica, device) -> arrival ticket, for every device that had to arrive before the exchange ran
    waited_for: dict[tuple[int, int], int]
    done: int
    start_ns: int
    end_ns: int


def _job_devices() -> int | None:
    """``--ipus-per-replica`` of the poprun job this process is an instance of, if any."""
    from popcontract.environment import NUM_IPUS_PER_REPLICA

    return settings.optional_integer(NUM_IPUS_PER_REPLICA, minimum=1)



class _Run:
    """One batch through the pipeline on one local replica: what its devices' threads and its host
    feed share (queues between stages, the meeting of the host exchanges, events), and each one's loop."""

    def __init__(self, pipeline: Pipeline, local: int, replica: int, params: dict[str, Any],
                 micro_batches: Sequence[tuple[Any, ...]], on_grads: Callable[[str, Any], None],
                 update: Callable[[int, int], dict[str, Any]] | None) -> None:
        self.pipeline, self.local, self.replica = pipeline, local, replica
        self.params, self.on_grads, self.update = params, on_grads, update
        self.K, self.M = K, M = len(pipeline.stages), len(micro_batches)
        self.forward_in: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(K)]
        self.backward_in: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(K)]
        self.losses: list[Any] = [None] * M
        self.events: list[Event] = []
        self.records: list[ExchangeRecord] = []
        self.failed = threading.Event()
        self.inputs = list(micro_batches)
        self.timetable = pipeline.timetable(M)
        # the host feeds inside the meeting
        self.host_inside = pipeline.feed is not None and pipeline.sync_pattern == sync.FULL
        self.key, self.meeting = pipeline._meeting(local, self.timetable, self.host_inside)
        self.fed = [threading.Event() for _ in range(M)]  # the host has fed micro-batch m
        self.taken = [threading.Event() for _ in range(M)]  # stage 0 has taken micro-batch m
        self.requests: queue.SimpleQueue[Any] = queue.SimpleQueue()  # (stage, micro-batch) of a finished backward
        self.released: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(K)]  # a stage's new params

    def stop_all(self) -> None:
        """Wake every wait of this run: a device or the feed failed."""
        self.failed.set()
        for q in (*self.forward_in, *self.backward_in, *self.released):
            q.put(_ABORT)
        self.requests.put(_ABORT)
        self.meeting.abort()
        for event in (*self.fed, *self.taken):
            event.set()

    def host_loop(self) -> None:
        """The host's data feed: inside each input exchange (full), or one micro-batch ahead."""
        feed = self.pipeline.feed
        assert feed is not None
        group = sync.group(self.pipeline.sync_pattern, 0, self.K)
        m = -1
        try:
            for m in range(self.M):
                if self.host_inside:
                    x = Exchange(sync.INPUT, m, group)
                    self.meeting.arrive(x, self.replica, HOST)
                elif m:
                    self.taken[m - 1].wait()  # double buffering: feed m while stage 0 works on m - 1
                if self.failed.is_set():
                    raise _Stopped
                start = time.perf_counter_ns()
                self.inputs[m] = tuple(feed(*self.inputs[m]))
                self.events.append(Event(self.replica, HOST, sync.INPUT, -1, m, start, time.perf_counter_ns()))
                self.fed[m].set()
                if self.host_inside:
                    self.meeting.leave(x)
        except (_Stopped, threading.BrokenBarrierError):
            self.stop_all()
            raise _Stopped from None
        except BaseException as e:
            self.stop_all()
            raise PipelineStageError(f"replica {self.replica}: the host's feed of micro-batch {m} failed: "
                                     f"{type(e).__name__}: {e}") from e

    def exchange(self, x: Exchange, s: int) -> None:
        """Meet the exchange's group; the devices doing the I/O do it while the others wait."""
        device = self.pipeline.stages[s].device
        io = s == (0 if x.kind == sync.INPUT else self.K - 1)
        try:
            self.meeting.arrive(x, self.replica, device)
            start = time.perf_counter_ns()
            if io and x.kind == sync.INPUT and self.pipeline.feed is not None and not self.host_inside:
                self.fed[x.micro_batch].wait()  # fed ahead by the host
                if self.failed.is_set():
                    raise _Stopped
            end = time.perf_counter_ns()
            self.meeting.leave(x)
            if io and x.kind == sync.INPUT:
                self.taken[x.micro_batch].set()
        except threading.BrokenBarrierError:
            raise _Stopped from None
        if io:  # every member arrived before the barrier let anyone go
            waited = dict(self.meeting.arrivals[x.kind, x.micro_batch])
            self.records.append(ExchangeRecord(x.kind, x.micro_batch, waited, next(self.meeting.tickets), start, end))
            self.events.append(Event(self.replica, device, x.kind, s, x.micro_batch, start, end))

    @staticmethod
    def take(q: queue.SimpleQueue[Any], op: Op) -> Any:
        item = q.get()
        if item is _ABORT:
            raise _Stopped
        m, value = item
        assert m == op.micro_batch, (m, op)  # the schedules keep every queue in micro-batch order
        return value

    def device_loop(self, s: int, items: list[Op | Exchange]) -> None:
        """Stage ``s``'s device: its forwards, backwards and exchanges in the schedule's order."""
        stage = self.pipeline.stages[s]
        mine = self.params  # replaced by each update in continuous pipelining
        stash = self.pipeline._stashes[self.local, s]
        stash.clear()  # what a failed step left
        op: Op | Exchange | None = None
        try:
            for op in items:
                if self.failed.is_set():
                    raise _Stopped
                if isinstance(op, Exchange):
                    self.exchange(op, s)
                    continue
                if op.kind == FORWARD:
                    start, end = self._forward(s, op, mine, stash)
                else:
                    start, end, mine = self._backward(s, op, mine, stash)
                self.events.append(Event(self.replica, stage.device, op.kind, s, op.micro_batch, start, end))
        except _Stopped:
            self.stop_all()  # the rest of this replica's devices too
            raise
        except BaseException as e:
            self.stop_all()
            assert op is not None
            what = op.describe() if isinstance(op, Exchange) else f"{op.kind} of micro-batch {op.micro_batch}"
            raise PipelineStageError(f"replica {self.replica}: {stage.label(s)} (device {stage.device}) failed in "
                                     f"the {what}: {type(e).__name__}: {e}") from e

    def _forward(self, s: int, op: Op, mine: dict[str, Any], stash: Stash) -> tuple[int, int]:
        """Stage ``s``'s forward of one micro-batch: its output goes to the next stage (the loss, from
        the last); what its backward needs is stashed. Returns when it started and ended."""
        m = op.micro_batch
        carry = self.take(self.forward_in[s], op) if s else None
        start = time.perf_counter_ns()
        out, saved = self.pipeline.stages[s].forward(mine, carry, *self.inputs[m])
        stash.put(m, saved)
        del saved
        end = time.perf_counter_ns()
        if s == self.K - 1:
            self.losses[m] = out
        else:
            self.forward_in[s + 1].put((m, out))
        return start, end

    def _backward(self, s: int, op: Op, mine: dict[str, Any], stash: Stash) -> tuple[int, int, dict[str, Any]]:
        """Stage ``s``'s backward of one micro-batch: its weights' gradients to ``on_grads``, the
        carried gradient to the stage before; in continuous pipelining, the stage's params after
        its update. Returns when it started and ended, and the params to compute with from now on."""
        m = op.micro_batch
        stage = self.pipeline.stages[s]
        grad_out = self.take(self.backward_in[s], op) if s < self.K - 1 else None
        start = time.perf_counter_ns()
        assert stage.backward is not None
        grad_carry, grads = stage.backward(mine, stash.pop(m), grad_out)
        for w in stage.weights:
            self.on_grads(w, grads[w])
        end = time.perf_counter_ns()
        if s:
            self.backward_in[s - 1].put((m, grad_carry))
        if self.update is not None:  # wait for this stage's update on the calling thread
            self.requests.put((s, m))
            new = self.released[s].get()
            if new is _ABORT:
                raise _Stopped
            mine = new
        return start, end, mine


__all__ = ["BACKWARD", "FORWARD", "HOST", "ExchangeRecord", "Pipeline", "PipelineStageError"]
