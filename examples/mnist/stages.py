"""The network of :mod:`.model` as two pipeline stages, for ``examples/mnist_pipeline.py``.

- stage 0 on device 0: the hidden layer, ``h = relu(x @ W0 + b0)``;
- stage 1 on device 1: the output layer and the loss, ``cross_entropy(softmax(h @ W1 + b1), y)``.

Each stage computes its part of :func:`.model.loss_and_grads` with the same operations in the
same order: every sum a :func:`~popdist_py.engine.canonical_sum` over a fixed tree, per-sample
gradients summed over the micro-batch that way and divided by ``B``. The stages run one after the
other (:meth:`Pipeline.sequential <popdist_py.engine.pipeline.Pipeline.sequential>`) therefore
give bitwise the gradients of the unsplit model, and pipelined bitwise those again: a stage
accumulates its micro-batches' gradients in micro-batch order under either schedule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from popdist_py.engine import canonical_sum
from popdist_py.engine.pipeline import ONE_F_ONE_B, Pipeline, Stage

from .model import row_dot

#: The stages' weights, in the order of :data:`.model.PARAMS`.
HIDDEN_WEIGHTS = ("W0", "b0")
OUTPUT_WEIGHTS = ("W1", "b1")
NUM_STAGES = 2

Weights = Mapping[str, np.ndarray]


def hidden_forward(params: Weights, carry: None, x: np.ndarray, y: np.ndarray
                   ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Stage 0: the hidden activations ``h``; keeps the input and the pre-activation for the backward."""
    x = np.asarray(x, np.float32)
    z0 = row_dot(x, params["W0"]) + params["b0"]
    return np.maximum(z0, np.float32(0)), (x, z0)


def hidden_backward(params: Weights, saved: tuple[np.ndarray, np.ndarray], d_h: np.ndarray
                    ) -> tuple[None, dict[str, np.ndarray]]:
    """Stage 0: the gradients of W0 and b0 from the output stage's ``d loss / d h``."""
    x, z0 = saved
    n = np.float32(len(x))
    d_z0 = d_h * (z0 > 0)
    return None, {"W0": canonical_sum(x[:, :, None] * d_z0[:, None, :]) / n,  # per-sample outer products
                  "b0": canonical_sum(d_z0) / n}


def output_forward(params: Weights, h: np.ndarray, x: np.ndarray, y: np.ndarray
                   ) -> tuple[np.float32, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Stage 1: the mean cross-entropy of the micro-batch; keeps ``h``, the softmax's numerators and the labels."""
    z1 = row_dot(h, params["W1"]) + params["b1"]
    shifted = z1 - z1.max(axis=1, keepdims=True)  # max is exact in any order
    exp = np.exp(shifted)
    log_probs = shifted - np.log(canonical_sum(exp, axis=1))[:, None]
    loss = -canonical_sum(log_probs[np.arange(len(y)), y]) / np.float32(len(y))
    return np.float32(loss), (h, exp, y)


def output_backward(params: Weights, saved: tuple[np.ndarray, np.ndarray, np.ndarray], grad_out: None
                    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Stage 1: ``d loss / d h`` for stage 0, and the gradients of W1 and b1."""
    h, exp, y = saved
    n = np.float32(len(y))
    d_z1 = exp / canonical_sum(exp, axis=1)[:, None]  # per sample: softmax - one-hot
    d_z1[np.arange(len(y)), y] -= np.float32(1)
    d_h = row_dot(d_z1, params["W1"].T)
    return d_h, {"W1": canonical_sum(h[:, :, None] * d_z1[:, None, :]) / n, "b1": canonical_sum(d_z1) / n}


def stages() -> list[Stage]:
    """The two stages, the hidden layer on device 0 and the output layer with the loss on device 1."""
    return [Stage(hidden_forward, hidden_backward, device=0, weights=HIDDEN_WEIGHTS, name="hidden layer"),
            Stage(output_forward, output_backward, device=1, weights=OUTPUT_WEIGHTS, name="output layer and loss")]


def pipeline(devices_per_replica: int = NUM_STAGES, schedule: str = ONE_F_ONE_B, **options: Any) -> Pipeline:
    """The stages on ``devices_per_replica`` devices per replica (at least 2), run in ``schedule`` order."""
    return Pipeline(stages(), devices_per_replica, schedule, **options)
