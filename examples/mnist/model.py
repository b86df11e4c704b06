"""The network of PopXL's MNIST example, in numpy: ``softmax(relu(x @ W0 + b0) @ W1 + b1)``, cross-entropy loss.

Everything stays float32, so a replica's arithmetic depends only on its own micro-batch and
weights: the same replica computes the same bits whether it runs as a thread or a process.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

PARAMS = ("W0", "b0", "W1", "b1")


class Params(NamedTuple):
    W0: np.ndarray  # [input, hidden]
    b0: np.ndarray  # [hidden]
    W1: np.ndarray  # [hidden, classes]
    b1: np.ndarray  # [classes]


def init_params(input_size: int, hidden_size: int, num_classes: int, seed: int) -> Params:
    """He-normal weights and zero biases, from ``seed`` alone: identical on every instance and split."""
    rng = np.random.default_rng([seed, 0x5EED])  # distinct from the shuffle's default_rng(seed + epoch)
    w0 = rng.standard_normal((input_size, hidden_size)) * np.sqrt(2.0 / input_size)
    w1 = rng.standard_normal((hidden_size, num_classes)) * np.sqrt(2.0 / hidden_size)
    return Params(
        w0.astype(np.float32), np.zeros(hidden_size, np.float32),
        w1.astype(np.float32), np.zeros(num_classes, np.float32),
    )


def logits(p: Params, x: np.ndarray) -> np.ndarray:
    return np.maximum(x @ p.W0 + p.b0, np.float32(0)) @ p.W1 + p.b1


def loss_and_grads(p: Params, x: np.ndarray, y: np.ndarray) -> tuple[np.float32, Params]:
    """Mean cross-entropy over the micro-batch and its gradients (hand-written backward pass)."""
    n = np.float32(len(x))
    z0 = x @ p.W0 + p.b0
    h = np.maximum(z0, np.float32(0))
    z1 = h @ p.W1 + p.b1
    shifted = z1 - z1.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(len(x))
    loss = -log_probs[rows, y].sum() / n
    d_z1 = np.exp(log_probs)
    d_z1[rows, y] -= np.float32(1)
    d_z1 /= n
    d_z0 = (d_z1 @ p.W1.T) * (z0 > 0)
    grads = Params(x.T @ d_z0, d_z0.sum(axis=0), h.T @ d_z1, d_z1.sum(axis=0))
    return np.float32(loss), grads


def correct(p: Params, x: np.ndarray, y: np.ndarray, mask: np.ndarray) -> int:
    """How many of the real (``mask``) samples are classified right."""
    return int(((logits(p, x).argmax(axis=1) == y) & mask).sum())
