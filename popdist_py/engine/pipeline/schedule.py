"""Pipeline schedules: the order in which each device runs its stage's forwards and backwards.

With ``K`` stages (stage ``s`` on its own device) and ``M`` micro-batches per weight update:

- **GPipe**: every device runs all ``M`` forwards, then all ``M`` backwards. Simple, but stage
  ``s`` keeps the activations of all ``M`` micro-batches until their backwards.
- **1F1B** (one forward, one backward; PipeDream-Flush, PopART's pipelining): stage ``s`` runs
  ``K - 1 - s`` warm-up forwards, then alternates one forward and one backward, then drains the
  remaining backwards. It keeps at most ``K - s`` micro-batches in flight, whatever ``M``.

Both run each stage's forwards and backwards in micro-batch order, so a stage's gradients are
accumulated in the same order as without pipelining (the same bits), and both leave the same
bubble, ``(K - 1) / (M + K - 1)`` of each device's time when stages cost alike.
"""

from __future__ import annotations

from typing import NamedTuple

FORWARD, BACKWARD = "forward", "backward"
GPIPE, ONE_F_ONE_B = "gpipe", "1f1b"
SCHEDULES = (ONE_F_ONE_B, GPIPE)


class Op(NamedTuple):
    """One stage's forward or backward of one micro-batch."""

    kind: str  # FORWARD or BACKWARD
    stage: int
    micro_batch: int

    def describe(self) -> str:
        return f"{self.kind} of stage {self.stage}, micro-batch {self.micro_batch}"


def device_order(schedule: str, stage: int, stages: int, micro_batches: int, backward: bool = True) -> list[Op]:
    """The ops of ``stage`` (of ``stages``) in the order its device runs them; ``backward=False``:
    forwards only (inference, or a stage whose backward nothing needs)."""
    forwards = [Op(FORWARD, stage, m) for m in range(micro_batches)]
    if not backward:
        return forwards
    backwards = [Op(BACKWARD, stage, m) for m in range(micro_batches)]
    if schedule == GPIPE:
        return forwards + backwards
    if schedule != ONE_F_ONE_B:
        raise ValueError(f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    warmup = min(stages - 1 - stage, micro_batches)
    order = forwards[:warmup]
    for m in range(micro_batches - warmup):
        order += [forwards[warmup + m], backwards[m]]
    return order + backwards[micro_batches - warmup:]


def in_flight(order: list[Op]) -> int:
    """The most micro-batches whose forward has run and backward not yet: what a stage stashes."""
    most = live = 0
    for op in order:
        live += 1 if op.kind == FORWARD else -1
        most = max(most, live)
    return most


def ideal_bubble(stages: int, micro_batches: int) -> float:
    """The idle fraction of each device with equal stages: ``(K - 1) / (M + K - 1)``."""
    return (stages - 1) / (micro_batches + stages - 1)


__all__ = ["BACKWARD", "FORWARD", "GPIPE", "ONE_F_ONE_B", "SCHEDULES", "Op", "device_order", "ideal_bubble",
           "in_flight"]
