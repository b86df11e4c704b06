"""The network of :mod:`.model` as two pipeline stages, for ``examples/mnist_pipeline.py``.

- stage 0 on device 0: the hidden layer, ``h = relu(x @ W0 + b0)``;
- stage 1 on device 1: the output layer and the loss, ``cross_entropy(softmax(h @ W1 + b1), y)``.

The stages are the layer functions :func:`.model.loss_and_grads` itself is made of, so the stages
run one after the other (:meth:`Pipeline.sequential <popdist_py.engine.pipeline.Pipeline.sequential>`)
give bitwise the gradients of the unsplit model, and pipelined bitwise those again: a stage
accumulates its micro-batches' gradients in micro-batch order under either schedule.
"""

from __future__ import annotations

from typing import Any

from popdist_py.engine.pipeline import ONE_F_ONE_B, Pipeline, Stage

from .model import hidden_backward, hidden_forward, output_backward, output_forward

#: The stages' weights, in the order of :data:`.model.PARAMS`.
HIDDEN_WEIGHTS = ("W0", "b0")
OUTPUT_WEIGHTS = ("W1", "b1")
NUM_STAGES = 2


def stages() -> list[Stage]:
    """The two stages, the hidden layer on device 0 and the output layer with the loss on device 1."""
    return [Stage(hidden_forward, hidden_backward, device=0, weights=HIDDEN_WEIGHTS, name="hidden layer"),
            Stage(output_forward, output_backward, device=1, weights=OUTPUT_WEIGHTS, name="output layer and loss")]


def pipeline(devices_per_replica: int = NUM_STAGES, schedule: str = ONE_F_ONE_B, **options: Any) -> Pipeline:
    """The stages on ``devices_per_replica`` devices per replica (at least 2), run in ``schedule`` order."""
    return Pipeline(stages(), devices_per_replica, schedule, **options)
