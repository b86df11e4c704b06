"""The linear model, data, optimizers and location settings the engine's training tests use, in one
process and under mpiexec."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from popdist_py.engine._training.locations import TensorLocation, TensorStorage, TileSet, TrainingOptions
from popdist_py.engine._training.training import canonical_sum
from popdist_py.engine.batch_invariant import matmul, outer_sum
from popdist_py.engine.optimizers import LAMB, SGD, Adam, AdamW, Optimizer

SAMPLES = 16  # per batch, over all replicas and micro-batches
STEPS = 3
rng = np.random.default_rng(14)
W0 = rng.standard_normal((5, 3)).astype(np.float32)
B0 = np.zeros(3, np.float32)
X = rng.standard_normal((STEPS, SAMPLES, 5)).astype(np.float32)
Y = rng.standard_normal((STEPS, SAMPLES, 3)).astype(np.float32)

OPTIMIZERS: dict[str, Callable[[], Optimizer]] = {
    "sgd": lambda: SGD(0.1),
    "momentum": lambda: SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: Adam(0.01, weight_decay=0.01),
    "adamw": lambda: AdamW(0.01),
    "lamb": lambda: LAMB(0.01, weight_decay=0.01),
}


def linear_model(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """Mean squared error of ``x @ W + b``, batch-invariant: each sample's error from its own row
    (``matmul``), the gradients the canonical tree of the per-sample ones (``outer_sum``)."""
    err = matmul(x, params["W"]) + params["b"] - y
    n = np.float32(len(x))
    grads = {"W": outer_sum(x, np.float32(2) * err) / n,
             "b": canonical_sum(np.float32(2) * err) / n}
    return float(np.mean(err * err)), grads


def host_batch(x: np.ndarray, replicas: int, accumulation: int) -> np.ndarray:
    """Samples of one batch as [A, L, B, ...]: replica r takes the r-th block, micro-batch a its a-th part."""
    micro = len(x) // (replicas * accumulation)
    return x.reshape(replicas, accumulation, micro, *x.shape[1:]).transpose(1, 0, 2, *range(3, x.ndim + 2))


def options(accumulation: int = 1, shard: Any = None, **kw: Any) -> TrainingOptions:
    opts = TrainingOptions(accumulation_factor=accumulation, **kw)
    if shard is not None:
        opts.optimizer_state_tensor_location_settings.location = TensorLocation(
            replicated_tensor_sharding=True, sharding_domain=None if shard is True else shard)
    return opts

# -- tensor locations: sharded weights (ZeRO-3), off chip, read ahead --------------------------------

def located(accumulation: int = 1, *, state: str = "whole", weights: str = "whole", domain: Any = None,
            **kw: Any) -> TrainingOptions:
    """Options placing the optimizer state and the weights: "whole", "sharded", "off" (off chip),
    "off-sharded", or "io" (off chip, sharded, read ahead)."""
    opts = TrainingOptions(accumulation_factor=accumulation, **kw)
    for settings, how in ((opts.optimizer_state_tensor_location_settings, state),
                          (opts.weight_tensor_location_settings, weights)):
        settings.location = TensorLocation(
            storage=TensorStorage.OFF_CHIP if how.startswith(("off", "io")) else "on_chip",
            replicated_tensor_sharding=how in ("sharded", "off-sharded", "io"), sharding_domain=domain,
            load_tile_set=TileSet.IO if how == "io" else TileSet.COMPUTE)
    return opts


PLACEMENTS: list[dict[str, Any]] = [
    dict(state="sharded"), dict(weights="sharded", state="sharded"), dict(weights="sharded"),
    dict(weights="off", state="off"), dict(weights="io", state="io"), dict(weights="off-sharded"),
    dict(weights="io", state="sharded")]

# -- accumulators: off chip and sharded --------------------------------------------------------------

def with_accumulators(accumulation: int, how: str, state: str = "whole") -> TrainingOptions:
    """``located`` options whose accumulators are "whole", "off" (off chip), "sharded" or "off-sharded"."""
    opts = located(accumulation, state=state)
    opts.accumulator_tensor_location_settings.location = TensorLocation(
        storage=TensorStorage.OFF_CHIP if how.startswith("off") else TensorStorage.ON_CHIP,
        replicated_tensor_sharding=how.endswith("sharded"))
    return opts
