"""The network of PopXL's MNIST example, in numpy: ``softmax(relu(x @ W0 + b0) @ W1 + b1)``, cross-entropy loss.

Batch-invariant, so that every split of the samples into replicas, instances and micro-batches
gives the same weights: the products are :func:`~popdist_py.engine.batch_invariant.matmul` (a
sample's activations depend on that sample alone, never on how many share the call, as they
would with ``@``), the weights' gradients :func:`~popdist_py.engine.batch_invariant.outer_sum`
and every other sum over samples or classes :func:`~popdist_py.engine.canonical_sum` (the fixed
pairwise tree the Trainer's accumulation and the engine's reductions continue). A batch's
gradient is that tree of per-sample gradients divided by ``B``; for ``B`` a power of two,
accumulating ``A`` micro-batches of ``B`` is then bitwise one batch of ``A x B``, and ``R``
replicas of ``B`` are bitwise one replica of ``R x B``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from popdist_py.engine import canonical_sum
from popdist_py.engine.batch_invariant import matmul, outer_sum

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


def forward(p: Params, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pre-activation z0, hidden h, logits z1), each row from its own sample only."""
    z0 = matmul(x, p.W0) + p.b0
    h = np.maximum(z0, np.float32(0))
    return z0, h, matmul(h, p.W1) + p.b1


Weights = Mapping[str, np.ndarray]


def hidden_forward(params: Weights, carry: None, x: np.ndarray, y: np.ndarray
                   ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """The hidden layer (pipeline stage 0): the activations ``h``; keeps the input and the
    pre-activation for the backward."""
    x = np.asarray(x, np.float32)
    z0 = matmul(x, params["W0"]) + params["b0"]
    return np.maximum(z0, np.float32(0)), (x, z0)


def hidden_backward(params: Weights, saved: tuple[np.ndarray, np.ndarray], d_h: np.ndarray
                    ) -> tuple[None, dict[str, np.ndarray]]:
    """The hidden layer (pipeline stage 0): the gradients of W0 and b0 from the output stage's ``d loss / d h``."""
    x, z0 = saved
    n = np.float32(len(x))
    d_z0 = d_h * (z0 > 0)
    return None, {"W0": outer_sum(x, d_z0) / n,  # the tree of per-sample outer products
                  "b0": canonical_sum(d_z0) / n}


def output_forward(params: Weights, h: np.ndarray, x: np.ndarray, y: np.ndarray
                   ) -> tuple[np.float32, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The output layer and loss (stage 1): the mean cross-entropy of the micro-batch; keeps ``h``,
    the softmax's numerators and the labels."""
    z1 = matmul(h, params["W1"]) + params["b1"]
    shifted = z1 - z1.max(axis=1, keepdims=True)  # max is exact in any order
    exp = np.exp(shifted)
    log_probs = shifted - np.log(canonical_sum(exp, axis=1))[:, None]
    loss = -canonical_sum(log_probs[np.arange(len(y)), y]) / np.float32(len(y))
    return np.float32(loss), (h, exp, y)


def output_backward(params: Weights, saved: tuple[np.ndarray, np.ndarray, np.ndarray], grad_out: None
                    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The output layer and loss (stage 1): ``d loss / d h`` for stage 0, and the gradients of W1 and b1."""
    h, exp, y = saved
    n = np.float32(len(y))
    d_z1 = exp / canonical_sum(exp, axis=1)[:, None]  # per sample: softmax - one-hot
    d_z1[np.arange(len(y)), y] -= np.float32(1)
    d_h = matmul(d_z1, params["W1"].T)
    return d_h, {"W1": outer_sum(h, d_z1) / n, "b1": canonical_sum(d_z1) / n}


def loss_and_grads(p: Params | Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[np.float32, Params]:
    """Mean cross-entropy over the micro-batch and its gradients (hand-written backward pass):
    per-sample values summed with ``canonical_sum`` over the batch axis, then divided by ``B``.
    The layer functions above, one after the other (they are also the pipeline's stages)."""
    params = as_params(p)._asdict()
    h, hidden = hidden_forward(params, None, x, y)
    loss, output = output_forward(params, h, x, y)
    d_h, g1 = output_backward(params, output, None)
    _, g0 = hidden_backward(params, hidden, d_h)
    return loss, Params(g0["W0"], g0["b0"], g1["W1"], g1["b1"])


def correct(p: Params | Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray, mask: np.ndarray) -> int:
    """How many of the real (``mask``) samples are classified right."""
    _, _, z1 = forward(as_params(p), np.asarray(x, np.float32))
    return int(((z1.argmax(axis=1) == y) & mask).sum())
