"""The network on the engine's :class:`~popdist_py.engine.Trainer`: the example states *what* it
wants (an optimizer, an accumulation factor, which classes of tensors are sharded or off chip) and
the engine shards, gathers, reduces and updates.

The command line's choices map onto PopART's settings in Python spelling:

- ``--optimizer``: ``sgd``, ``momentum`` (SGD with momentum 0.9), ``adam`` or ``lamb``.
- ``--shard optimizer``: the optimizer state is sharded over the replicas (ZeRO-1/2: the gradient
  is reduce-scattered, each replica updates its shard, the weight is all-gathered).
  ``--shard weights``: the weights too (ZeRO-3: a full weight exists only inside the step), with
  their state sharded alike, so each replica updates only its own shards.
- ``--offchip optimizer``: the optimizer state lives off chip (memory-mapped remote buffers), read
  ahead on a background thread (``load_tile_set=IO``); ``--offchip weights``: the weights too.

The levels are cumulative (``weights`` includes the optimizer state) because a weight placed
further out than its own state buys nothing: the state is as large or larger. Every choice
gives bitwise the same weights (the engine's reductions and updates are elementwise over fixed
trees), which the tests check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from popdist_py.engine import (
    Runtime,
    StepContext,
    TensorStorage,
    TileSet,
    Trainer,
    TrainingOptions,
    ops,
)
from popdist_py.engine.optimizers import LAMB, SGD, Adam, Optimizer
from popdist_py.engine.pipeline import Pipeline

from .model import PARAMS, Params, correct, loss_and_grads

log = logging.getLogger(__name__)

#: ``--optimizer`` choices -> (constructor from the learning rate, default learning rate). The
#: defaults were picked on the bundled digits (10 epochs, global batch 32): each reaches >= 95%.
OPTIMIZERS: dict[str, tuple[Callable[[float], Optimizer], float]] = {
    "sgd": (lambda lr: SGD(lr), 0.1),
    "momentum": (lambda lr: SGD(lr, momentum=0.9), 0.02),
    "adam": (lambda lr: Adam(lr), 0.01),
    "lamb": (lambda lr: LAMB(lr), 0.005),
}
#: ``--shard`` and ``--offchip`` choices, in order: each level includes the ones before it.
LEVELS = ("none", "optimizer", "weights")


def make_optimizer(name: str, lr: float | None) -> Optimizer:
    """The optimizer ``name`` with learning rate ``lr`` (None: its default)."""
    build, default = OPTIMIZERS[name]
    return build(default if lr is None else lr)


def training_options(accumulation: int, shard: str, offchip: str) -> TrainingOptions:
    """PopART's settings for ``--accumulation``, ``--shard`` and ``--offchip``."""
    opts = TrainingOptions(accumulation_factor=accumulation, reduction="mean")
    classes = {"optimizer": (opts.optimizer_state_tensor_location_settings,),
               "weights": (opts.optimizer_state_tensor_location_settings, opts.weight_tensor_location_settings)}
    for settings in classes.get(shard, ()):
        settings.location.replicated_tensor_sharding = True  # over all replicas (sharding_domain None)
    for settings in classes.get(offchip, ()):
        settings.location.storage = TensorStorage.OFF_CHIP
        settings.location.load_tile_set = TileSet.IO  # read ahead while the tensor before it is worked on
    return opts


def _loss_and_grads(params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray
                    ) -> tuple[np.float32, dict[str, np.ndarray]]:
    """The model's loss and gradients with the gradients by name, as the Trainer's signature has them."""
    loss, grads = loss_and_grads(params, x, y)
    return loss, grads._asdict()


class Network:
    """The weights of one :class:`Runtime` under a :class:`Trainer`, and the data-parallel evaluation.

    ``model``: what the trainer trains, the whole network's loss and gradients by default, or a
    :class:`~popdist_py.engine.pipeline.Pipeline` of its stages (``examples/mnist_pipeline.py``)."""

    def __init__(self, rt: Runtime, params: Params, optimizer: Optimizer, options: TrainingOptions,
                 batch_size: int, model: Callable[..., Any] | Pipeline | None = None) -> None:
        self.rt = rt
        input_size = params.W0.shape[0]
        self.trainer = Trainer(rt, dict(zip(PARAMS, params, strict=True)), _loss_and_grads if model is None else model,
                               optimizer,
                               [(batch_size, input_size), (batch_size,)], options)

    def describe(self) -> list[str]:
        """Where each weight and its optimizer state live, one line per weight."""
        lines = []
        for p in self.trainer.placements.values():
            line = p.weight.describe()
            wheres = {t.describe().split(": ", 1)[1] for t in p.states.values()}
            if len(wheres) == 1:
                line += f"; its state ({', '.join(p.states)}): {wheres.pop()}"
            elif wheres:
                line += "; " + "; ".join(t.describe() for t in p.states.values())
            lines.append(line)
        return lines

    def train_step(self, x: np.ndarray, y: np.ndarray) -> float:
        """One update on this instance's ``[A, L, B, ...]`` part of a global batch; the loss (mean
        over micro-batches and all replicas)."""
        return float(self.trainer.step(x[None], y[None])[0])

    def evaluate_batch(self, weights: Params, x: np.ndarray, y: np.ndarray, mask: np.ndarray) -> int:
        """Correct predictions among the real samples of a whole global test batch (``weights``:
        :meth:`host_params`, read by every replica)."""

        def step(ctx: StepContext, x: np.ndarray, y: np.ndarray, mask: np.ndarray) -> np.ndarray:
            return ops.replicated_all_reduce(np.array([correct(weights, x, y, mask)], np.int64), op="add")

        return int(self.rt.run(step, x, y, mask)[0, 0])

    def host_params(self) -> Params:
        """The full weights (collective: every instance calls it and gets the same arrays)."""
        weights = self.trainer.weights()
        return Params(*(np.asarray(weights[name], np.float32) for name in PARAMS))

    def close(self) -> None:
        self.trainer.close()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
