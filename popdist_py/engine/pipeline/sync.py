"""Sync patterns: which of a replica's devices meet at each host exchange (PopART's SyncPattern).

A pipeline's host exchanges are the data feed of each micro-batch (before stage 0's forward) and
the return of its output (after the last stage's forward). The feed (``Pipeline(feed=...)``, the
host's work on a micro-batch) runs on a host thread of the replica. Which devices must arrive
before an exchange may run, and wait until it has run:

- ``full``: every device, at every exchange (PopART's default). The host feeds a micro-batch
  inside its input exchange, with every device waiting: the devices keep in step with the host,
  so a costly feed stalls all of them.
- ``single_pipeline``: only the device that does the I/O. The host feeds the next micro-batch on
  its own while the devices compute (one ahead: double buffering), and stage 0 takes it when it
  is ready; the last stage returns outputs while the others compute.
- ``replica_and_ladder``: the devices in two alternating groups, even and odd devices, each
  exchanging with the host on its own while the other computes; the host feeds ahead as in
  ``single_pipeline``. With two devices the groups are single devices.

Each device meets its exchanges in one global order, taken from a simulated run of the schedule
with ops of equal length (a valid timeline, so the order cannot deadlock). When the replicas of
the process run at once (the threads executor), a group's devices of every local replica meet;
when they run one after another (the cooperative executor), each replica's devices meet alone.
"""

from __future__ import annotations

import itertools
import threading
from typing import NamedTuple

from popdist_py.engine.pipeline.schedule import BACKWARD, FORWARD, Op

FULL, SINGLE_PIPELINE, REPLICA_AND_LADDER = "full", "single_pipeline", "replica_and_ladder"
SYNC_PATTERNS = (FULL, SINGLE_PIPELINE, REPLICA_AND_LADDER)
INPUT, OUTPUT = "input", "output"


class Exchange(NamedTuple):
    """A host exchange: the feed of a micro-batch (INPUT) or the return of its output (OUTPUT)."""

    kind: str
    micro_batch: int
    #: the stage indices whose devices meet at it
    group: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.kind} exchange of micro-batch {self.micro_batch}"


def sync_pattern(value: object) -> str:
    """``value`` as one of :data:`SYNC_PATTERNS` (PopART's ``Full``, ``SinglePipeline``,
    ``ReplicaAndLadder`` are accepted too), or ValueError naming the valid ones."""
    if isinstance(value, str):
        key = value.replace("_", "").lower()
        for name in SYNC_PATTERNS:
            if name.replace("_", "") == key:
                return name
    raise ValueError(f"sync_pattern={value!r} is not one of {', '.join(SYNC_PATTERNS)} (PopART's Full, "
                     "SinglePipeline, ReplicaAndLadder)")


def group(pattern: str, stage: int, stages: int) -> tuple[int, ...]:
    """The stages whose devices meet at an exchange that ``stage``'s device performs."""
    if pattern == FULL:
        return tuple(range(stages))
    if pattern == SINGLE_PIPELINE:
        return (stage,)
    return tuple(s for s in range(stages) if s % 2 == stage % 2)


def with_exchanges(orders: list[list[Op]], pattern: str) -> list[list[Op | Exchange]]:
    """Each device's ops with the exchanges it takes part in, in a deadlock-free global order."""
    K = len(orders)
    start, end = timeline(orders)
    micro_batches = sum(op.kind == FORWARD for op in orders[0])
    exchanges: list[tuple[int, int, Exchange]] = []  # (time, tie-break, exchange)
    for m in range(micro_batches):
        exchanges.append((start[FORWARD, 0, m], 0, Exchange(INPUT, m, group(pattern, 0, K))))
        exchanges.append((end[FORWARD, K - 1, m], 1, Exchange(OUTPUT, m, group(pattern, K - 1, K))))
    exchanges.sort(key=lambda e: (e[0], e[1], e[2].micro_batch))
    out: list[list[Op | Exchange]] = []
    for s, order in enumerate(orders):
        timed: list[tuple[int, int, int, Op | Exchange]] = [(start[op], 1, k, op) for k, op in enumerate(order)]
        timed += [(t, 0, k, x) for k, (t, _, x) in enumerate(exchanges) if s in x.group]
        out.append([item for *_, item in sorted(timed, key=lambda e: e[:3])])
    return out


class Meeting:
    """The host exchanges of one run of the pipeline, shared by the local replicas that meet at
    them: a barrier per group (its devices on every meeting replica), arrival tickets, and whether
    the run failed somewhere (then the barriers are broken, so nobody waits for a failed device)."""

    def __init__(self, exchanges: set[tuple[str, tuple[int, ...]]], replicas: int, host_inputs: bool = False) -> None:
        """``exchanges``: (kind, group) of every exchange of the run; ``host_inputs``: each
        replica's host thread meets its devices at input exchanges too (``full`` with a feed)."""
        self.barriers: dict[tuple[str, tuple[int, ...]], threading.Barrier] = {}
        for kind, g in exchanges:
            parties = (len(g) + (kind == INPUT and host_inputs)) * replicas
            if parties > 1:
                self.barriers[kind, g] = threading.Barrier(parties)
        self.tickets = itertools.count()
        #: (kind, micro-batch) -> (replica, device) -> arrival ticket
        self.arrivals: dict[tuple[str, int], dict[tuple[int, int], int]] = {}
        self.failed = threading.Event()
        self.running = replicas  # replicas whose run has not ended

    def arrive(self, x: Exchange, replica: int, device: int) -> None:
        """Wait for the exchange's group; BrokenBarrierError when the run failed."""
        self.arrivals.setdefault((x.kind, x.micro_batch), {})[replica, device] = next(self.tickets)
        barrier = self.barriers.get((x.kind, x.group))
        if barrier is not None:
            barrier.wait()

    def leave(self, x: Exchange) -> None:
        """Wait until the group's I/O is done (the second meeting of the exchange)."""
        barrier = self.barriers.get((x.kind, x.group))
        if barrier is not None:
            barrier.wait()

    def abort(self) -> None:
        self.failed.set()
        for barrier in self.barriers.values():
            barrier.abort()


def timeline(orders: list[list[Op]]) -> tuple[dict[tuple[str, int, int], int], dict[tuple[str, int, int], int]]:
    """Start and end times of every op with ops of length 1, each device in its order, an op
    starting when its inputs are ready (the previous stage's forward, the next stage's backward)."""
    start: dict[tuple[str, int, int], int] = {}
    end: dict[tuple[str, int, int], int] = {}
    position = [0] * len(orders)
    free = [0] * len(orders)
    K = len(orders)
    while any(p < len(o) for p, o in zip(position, orders, strict=True)):
        progressed = False
        for s, order in enumerate(orders):
            if position[s] == len(order):
                continue
            op = order[position[s]]
            needs = ([(FORWARD, s - 1, op.micro_batch)] if op.kind == FORWARD and s else []) + \
                    ([(BACKWARD, s + 1, op.micro_batch)] if op.kind == BACKWARD and s < K - 1 else [])
            if any(n not in end for n in needs):
                continue
            t = max([free[s], *(end[n] for n in needs)])
            start[op], end[op] = t, t + 1
            free[s] = t + 1
            position[s] += 1
            progressed = True
        if not progressed:  # pragma: no cover - the schedules are valid
            raise RuntimeError("pipeline schedule deadlocks")
    return start, end


__all__ = [
    "FULL",
    "INPUT",
    "OUTPUT",
    "REPLICA_AND_LADDER",
    "SINGLE_PIPELINE",
    "SYNC_PATTERNS",
    "Exchange",
    "Meeting",
    "group",
    "sync_pattern",
    "timeline",
    "with_exchanges",
]
