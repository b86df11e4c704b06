"""Pipeline stages: a model split into parts, each a forward and a backward on one device.

PopART annotates ops with a pipeline stage and a virtual graph (device); here a stage is the two
functions of one part of the model and the device it runs on::

    Stage(forward, backward, device=1, weights=("W1", "b1"))

- ``forward(params, carry, *micro_batch) -> (out, saved)``: ``carry`` is the previous stage's
  ``out`` (None for the first stage), ``micro_batch`` the micro-batch's host inputs (every stage
  gets them: the first reads the features, the last the labels); ``saved`` is what the backward
  needs (stashed per micro-batch in flight). The last stage's ``out`` is the loss.
- ``backward(params, saved, grad_out) -> (grad_carry, grads)``: ``grad_out`` is the next stage's
  ``grad_carry`` (None for the last stage); ``grads`` holds the gradients of this stage's
  ``weights`` by name. The first stage's ``grad_carry`` is ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from popdist_py import validate

Forward = Callable[..., tuple[Any, Any]]
Backward = Callable[[dict[str, Any], Any, Any], tuple[Any, dict[str, Any]]]


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: see the module docstring."""

    forward: Forward
    backward: Backward | None
    device: int
    weights: tuple[str, ...] = field(default=())
    name: str = ""

    def label(self, index: int) -> str:
        return f"stage {index}" + (f" ({self.name})" if self.name else "")


def check_stages(stages: Sequence[Stage], devices: int) -> list[Stage]:
    """``stages`` as a list, or one ValueError/TypeError naming what cannot run on ``devices``
    devices per replica: too many stages, a device outside ``[0, devices)`` or used twice, a
    trained stage without a backward, a weight claimed twice."""
    devices = validate.count("devices per replica", devices)
    stages = list(stages)
    if not stages:
        raise ValueError("a pipeline needs at least one stage")
    if len(stages) > devices:
        raise ValueError(f"{len(stages)} pipeline stages need {len(stages)} devices per replica, but a replica has "
                         f"{devices} (--ipus-per-replica / devices_per_replica): merge stages or add devices")
    owner: dict[str, int] = {}
    used: dict[int, int] = {}
    for s, stage in enumerate(stages):
        if not isinstance(stage, Stage):
            raise TypeError(f"pipeline stage {s} is a {type(stage).__name__}, not a Stage")
        if not callable(stage.forward):
            raise TypeError(f"{stage.label(s)}: forward is not callable")
        device = validate.index(f"{stage.label(s)}: device", stage.device, "devices per replica", devices)
        if device in used:
            raise ValueError(f"{stage.label(s)} and {stages[used[device]].label(used[device])} are both on device "
                             f"{device}; give each stage a device of its own in [0, {devices})")
        used[device] = s
        for w in stage.weights:
            if w in owner:
                raise ValueError(f"weight {w!r} belongs to {stages[owner[w]].label(owner[w])} and {stage.label(s)}; "
                                 "a weight lives on one stage")
            owner[w] = s
        if stage.backward is None and (stage.weights or any(st.weights for st in stages[:s])):
            trained = stage.weights or tuple(w for st in stages[:s] for w in st.weights)
            raise ValueError(f"{stage.label(s)} has no backward, but training needs it (for weights "
                             f"{', '.join(map(repr, trained))}); give it backward=(params, saved, grad_out) -> "
                             "(grad_carry, grads)")
        if stage.backward is not None and not callable(stage.backward):
            raise TypeError(f"{stage.label(s)}: backward is not callable")
    return stages


__all__ = ["Backward", "Forward", "Stage", "check_stages"]
