"""Horovod's timeline: each op's negotiation and run as a Chrome trace (chrome://tracing, Perfetto).

Rank 0 writes it, as Horovod's coordinator does: one trace "process" per op name, in which
``NEGOTIATE_<KIND>`` lasts from the op's submission on rank 0 until every rank has submitted it,
and ``<KIND>`` while it runs; ``CYCLE_START`` marks each turn of the background thread with
``mark_cycles``. Events are written as they happen (a trace cut short still opens).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import IO


class Timeline:
    """An open timeline file; ``close()`` ends its JSON array."""

    def __init__(self, path: str, mark_cycles: bool = False) -> None:
        self.mark_cycles = mark_cycles
        self._lock = threading.Lock()
        self._out: IO[str] = open(path, "w")  # noqa: SIM115  (open for the timeline's life)
        self._start = time.monotonic()
        self._pids: dict[str, int] = {}
        self._out.write("[\n")
        self._write({"name": "process_name", "ph": "M", "pid": 0,
                     "args": {"name": "horovod", "start_time_since_epoch_in_micros": int(time.time() * 1e6)}})

    def _write(self, event: dict[str, object]) -> None:
        self._out.write(json.dumps(event) + ",\n")

    def _event(self, name: str, phase: str, what: str = "") -> None:
        with self._lock:
            if self._out.closed:
                return
            pid = self._pids.get(name)
            if pid is None:
                pid = self._pids[name] = len(self._pids) + 1
                self._write({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
            event: dict[str, object] = {"ph": phase, "pid": pid, "tid": 0,
                                        "ts": int((time.monotonic() - self._start) * 1e6)}
            if what:
                event["name"] = what
            self._write(event)

    def negotiate(self, kind: str, name: str) -> None:
        self._event(f"{kind}.{name}", "B", f"NEGOTIATE_{kind.upper()}")

    def start(self, kind: str, name: str) -> None:
        self._event(f"{kind}.{name}", "E")
        self._event(f"{kind}.{name}", "B", kind.upper())

    def end(self, kind: str, name: str) -> None:
        self._event(f"{kind}.{name}", "E")

    def cycle(self) -> None:
        if self.mark_cycles:
            with self._lock:
                if not self._out.closed:
                    self._write({"name": "CYCLE_START", "ph": "i", "s": "g", "pid": 0, "tid": 0,
                                 "ts": int((time.monotonic() - self._start) * 1e6)})

    def close(self) -> None:
        with self._lock:
            if not self._out.closed:
                self._out.write("{}\n]\n")
                self._out.flush()
                os.fsync(self._out.fileno())
                self._out.close()
