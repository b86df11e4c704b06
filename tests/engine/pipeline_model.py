"""The pipelined model the engine's pipeline tests train, in one process and under mpiexec: a small MLP
whose layers are stages, its data, and the split of a batch into micro-batches."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from popdist_py.engine._training.training import canonical_sum
from popdist_py.engine.batch_invariant import matmul, outer_sum
from popdist_py.engine.pipeline import ONE_F_ONE_B, Pipeline, Stage

rng = np.random.default_rng(15)
SIZES = (6, 8, 8, 3)  # features, hidden, hidden, outputs
SAMPLES = 32
STEPS = 2
X = rng.standard_normal((STEPS, SAMPLES, SIZES[0])).astype(np.float32)
Y = rng.standard_normal((STEPS, SAMPLES, SIZES[-1])).astype(np.float32)


def init(sizes: tuple[int, ...] = SIZES) -> dict[str, np.ndarray]:
    r = np.random.default_rng(1)
    out = {}
    for k, (a, b) in enumerate(itertools.pairwise(sizes)):
        out[f"W{k}"] = (r.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        out[f"b{k}"] = np.zeros(b, np.float32)
    return out


def layer_stage(k: int, last: bool, device: int) -> Stage:
    """Layer ``k`` of an MLP (tanh inside, mean squared error after the last) as one stage."""
    W, b = f"W{k}", f"b{k}"

    def forward(params: dict[str, np.ndarray], carry: Any, x: np.ndarray, y: np.ndarray) -> tuple[Any, Any]:
        h = x if carry is None else carry
        z = matmul(h, params[W]) + params[b]
        if last:
            err = z - y
            return float(np.mean(err * err)), (h, err)
        a = np.tanh(z)
        return a, (h, a)

    def backward(params: dict[str, np.ndarray], saved: Any, grad_out: Any) -> tuple[Any, dict[str, np.ndarray]]:
        h, other = saved
        # the loss's gradient, or tanh's
        dz = np.float32(2) * other / np.float32(other.size) if last else grad_out * (np.float32(1) - other * other)
        grads = {W: outer_sum(h, dz), b: canonical_sum(dz)}
        return matmul(dz, params[W].T), grads

    return Stage(forward, backward, device, (W, b), name=f"layer {k}")


def mlp(devices: int = 3, schedule: str = ONE_F_ONE_B, placement: tuple[int, ...] | None = None,
        sync_pattern: str = "single_pipeline") -> Pipeline:
    layers = len(SIZES) - 1
    placement = placement or tuple(range(layers))
    return Pipeline([layer_stage(k, k == layers - 1, placement[k]) for k in range(layers)], devices, schedule,
                    sync_pattern)


def batch(x: np.ndarray, replicas: int, accumulation: int) -> np.ndarray:
    micro = len(x) // (replicas * accumulation)
    return x.reshape(replicas, accumulation, micro, *x.shape[1:]).swapaxes(0, 1)
