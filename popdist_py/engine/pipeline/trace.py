"""A step's timeline: which device ran which stage's forward or backward of which micro-batch, when.

Written as Chrome trace-event JSON (``chrome://tracing``, https://ui.perfetto.dev): one complete
event (``"ph": "X"``) per op, a process per replica and a thread per device, times in
microseconds from the step's start. :func:`bubble` measures the idle fraction of the devices
from the same events.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import NamedTuple

from popdist_py.engine.pipeline.schedule import BACKWARD, FORWARD


class Event(NamedTuple):
    """One op as it ran: perf_counter_ns at its start and end."""

    replica: int
    device: int
    kind: str
    stage: int
    micro_batch: int
    start_ns: int
    end_ns: int


def chrome_trace(events: Iterable[Event]) -> dict[str, object]:
    """The events as a Chrome trace-event document (replica -> pid, device -> tid)."""
    events = sorted(events, key=lambda e: e.start_ns)
    origin = events[0].start_ns if events else 0
    out: list[dict[str, object]] = []
    for replica in sorted({e.replica for e in events}):
        out.append({"name": "process_name", "ph": "M", "pid": replica, "args": {"name": f"replica {replica}"}})
        for device in sorted({e.device for e in events if e.replica == replica}):
            out.append({"name": "thread_name", "ph": "M", "pid": replica, "tid": device,
                        "args": {"name": f"device {device}"}})
    for e in events:
        out.append({"name": f"{e.kind[0].upper()}{e.micro_batch}", "cat": e.kind, "ph": "X",
                    "ts": (e.start_ns - origin) / 1e3, "dur": (e.end_ns - e.start_ns) / 1e3,
                    "pid": e.replica, "tid": e.device,
                    "args": {"stage": e.stage, "micro_batch": e.micro_batch, "kind": e.kind}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Iterable[Event], path: str | os.PathLike[str]) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(events), f)


def bubble(events: Iterable[Event]) -> float:
    """Idle fraction of the devices between the first op's start and the last op's end (forwards
    and backwards; host exchanges count as idle):
    ``1 - busy / (devices x span)``, over every replica's devices."""
    events = [e for e in events if e.kind in (FORWARD, BACKWARD)]  # compute only, not host exchanges
    if not events:
        return 0.0
    start = min(e.start_ns for e in events)
    span = max(e.end_ns for e in events) - start
    devices = len({(e.replica, e.device) for e in events})
    busy = sum(e.end_ns - e.start_ns for e in events)
    return 1.0 - busy / (devices * span) if span > 0 else 0.0


__all__ = ["Event", "bubble", "chrome_trace", "write_chrome_trace"]
