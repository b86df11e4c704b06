"""The network of PopXL's MNIST example, in numpy: ``softmax(relu(x @ W0 + b0) @ W1 + b1)``, cross-entropy loss.

Every sum here is :func:`~popdist_py.engine.canonical_sum`, a fixed pairwise tree of elementwise
float32 additions, never a BLAS product or a numpy reduction: those pick their order by shape,
memory layout and thread count, so a sample's result would depend on the batch it came in
(OpenBLAS blocks the rows of ``x @ W`` differently for 8 rows and for 32). With fixed trees a
sample's activations depend on that sample alone, and a batch's gradient is the pairwise tree
of per-sample gradients divided by ``B``. For ``B`` a power of two, accumulating ``A`` micro-batches
of ``B`` (the Trainer adds them in the same tree and divides by ``A``) is then bitwise one batch of
``A x B``, and ``R`` replicas of ``B`` are bitwise one replica of ``R x B`` (the mean over replicas
is the same tree).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from popdist_py.engine import canonical_sum

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


def as_params(p: Params | Mapping[str, np.ndarray]) -> Params:
    """The weights as :class:`Params` (the engine's Trainer passes them as a dict by name)."""
    return p if isinstance(p, Params) else Params(**{name: p[name] for name in PARAMS})


def row_dot(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``a @ w`` for ``a`` [B, K] and ``w`` [K, N], each row by its own fixed tree over K."""
    return canonical_sum(a[:, :, None] * w[None, :, :], axis=1)


def forward(p: Params, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pre-activation z0, hidden h, logits z1), each row from its own sample only."""
    z0 = row_dot(x, p.W0) + p.b0
    h = np.maximum(z0, np.float32(0))
    return z0, h, row_dot(h, p.W1) + p.b1


def loss_and_grads(p: Params | Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[np.float32, Params]:
    """Mean cross-entropy over the micro-batch and its gradients (hand-written backward pass):
    per-sample values summed with ``canonical_sum`` over the batch axis, then divided by ``B``."""
    p = as_params(p)
    x = np.asarray(x, np.float32)
    n = np.float32(len(x))
    z0, h, z1 = forward(p, x)
    shifted = z1 - z1.max(axis=1, keepdims=True)  # max is exact in any order
    exp = np.exp(shifted)
    log_probs = shifted - np.log(canonical_sum(exp, axis=1))[:, None]
    rows = np.arange(len(x))
    loss = -canonical_sum(log_probs[rows, y]) / n
    d_z1 = exp / canonical_sum(exp, axis=1)[:, None]  # per sample: softmax - one-hot
    d_z1[rows, y] -= np.float32(1)
    d_z0 = row_dot(d_z1, p.W1.T) * (z0 > 0)
    grads = Params(
        canonical_sum(x[:, :, None] * d_z0[:, None, :]) / n,  # per-sample outer products [B, input, hidden]
        canonical_sum(d_z0) / n,
        canonical_sum(h[:, :, None] * d_z1[:, None, :]) / n,
        canonical_sum(d_z1) / n,
    )
    return np.float32(loss), grads


def correct(p: Params | Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray, mask: np.ndarray) -> int:
    """How many of the real (``mask``) samples are classified right."""
    _, _, z1 = forward(as_params(p), np.asarray(x, np.float32))
    return int(((z1.argmax(axis=1) == y) & mask).sum())
