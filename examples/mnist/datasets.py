"""The data: MNIST from IDX files or scikit-learn's bundled digits, fed to replicas as PopDist does.

Feeding follows PopXL's MNIST example: a global batch is ``batch_size x A x R`` samples (``A``
micro-batches accumulated per update), split over replicas in global replica order. Every
instance computes the same epoch order, cuts the same global batch, takes its contiguous block
(``instance_batch_slice``), splits it ``[L, A x B, ...]`` (``split_for_replicas``) and lays it out
as PopART's ``[A, L, B, ...]``. Replica g therefore trains on samples ``[g*A*B, (g+1)*A*B)`` of every
global batch, its micro-batch a on the B of them from ``g*A*B + a*B``, whatever the split of
replicas into instances: ``R=2, B=4`` and ``A=2, B=4`` see exactly the global batches of ``R=1, B=8``,
in the same order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from popdist_py.data import instance_batch_slice, shard_indices, split_for_replicas

from . import idx

log = logging.getLogger(__name__)

NUM_CLASSES = 10
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
#: The bundled digits are split once, with this fixed seed, so the test set never depends on --seed.
DIGITS_SPLIT_SEED = 0
DIGITS_TEST_FRACTION = 0.2


@dataclass(frozen=True)
class Dataset:
    """Flattened float32 images in [0, 1] and int64 labels."""

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray

    @property
    def input_size(self) -> int:
        return int(self.train_x.shape[1])

    def describe(self) -> str:
        return (f"{self.name}: {len(self.train_x)} training and {len(self.test_x)} test images "
                f"of {self.input_size} pixels")


def load_mnist(data_dir: Path | str) -> Dataset:
    """The four MNIST IDX files (plain or ``.gz``) in ``data_dir``, validated; pixels / 255."""
    parts = {}
    for split, (images_name, labels_name) in MNIST_FILES.items():
        images_path, labels_path = idx.find(data_dir, images_name), idx.find(data_dir, labels_name)
        images, labels = idx.read_pair(images_path, labels_path)
        parts[split] = (images_path, images, labels)
    (train_path, train_images, _), (test_path, test_images, _) = parts["train"], parts["test"]
    if train_images.shape[1:] != test_images.shape[1:]:
        raise idx.IdxError(test_path, f"images are {'x'.join(map(str, test_images.shape[1:]))} but those of "
                                      f"{train_path} are {'x'.join(map(str, train_images.shape[1:]))}; they must match")

    def flat(images: np.ndarray) -> np.ndarray:
        return (images.reshape(len(images), -1).astype(np.float32) / np.float32(255.0))

    return Dataset(
        name=f"MNIST ({Path(data_dir)})",
        train_x=flat(train_images),
        train_y=parts["train"][2].astype(np.int64),
        test_x=flat(test_images),
        test_y=parts["test"][2].astype(np.int64),
    )


def load_digits() -> Dataset:
    """scikit-learn's 1,797 real 8x8 handwritten digits (no download), split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits as sklearn_digits  # slow import: only when used

    bunch = sklearn_digits()
    x = (bunch.data.astype(np.float32) / np.float32(16.0))  # pixel values are 0..16
    y = bunch.target.astype(np.int64)
    order = np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(x))
    n_test = round(len(x) * DIGITS_TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return Dataset("scikit-learn digits (8x8)", x[train], y[train], x[test], y[test])


def load(data_dir: Path | str | None) -> Dataset:
    return load_digits() if data_dir is None else load_mnist(data_dir)


@dataclass(frozen=True)
class Replicas:
    """Where this instance's replicas sit among all: R, L and the first global replica index."""

    total: int
    local: int
    offset: int

    def cut(self, global_batch: np.ndarray) -> np.ndarray:
        """This instance's block of a global batch's indices, shaped ``[L, B]``."""
        block = global_batch[instance_batch_slice(
            len(global_batch), num_total_replicas=self.total, num_local_replicas=self.local,
            replica_index_offset=self.offset)]
        return split_for_replicas(block, self.local)


def steps_per_epoch(n: int, batch_size: int, replicas: Replicas, accumulation: int = 1) -> int:
    """Full global batches in ``n`` samples; the last incomplete one is dropped."""
    return n // (batch_size * accumulation * replicas.total)


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled sample order of an epoch, from ``seed + epoch`` only: the same on every instance
    and after a resume, so no RNG state needs checkpointing."""
    return shard_indices(n, 1, 0, shuffle=True, seed=seed, epoch=epoch)


def train_batches(
    x: np.ndarray, y: np.ndarray, batch_size: int, replicas: Replicas, *, seed: int, epoch: int,
    accumulation: int = 1,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """This instance's ``([A, L, B, D], [A, L, B])`` part of each global batch of the epoch."""
    order = epoch_order(len(x), seed, epoch)
    size = batch_size * accumulation * replicas.total
    for k in range(steps_per_epoch(len(x), batch_size, replicas, accumulation)):
        rows = replicas.cut(order[k * size:(k + 1) * size])  # [L, A*B]
        rows = rows.reshape(replicas.local, accumulation, batch_size).swapaxes(0, 1)
        yield x[rows], y[rows]


def eval_batches(
    x: np.ndarray, y: np.ndarray, batch_size: int, replicas: Replicas
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every test sample once, in order: ``([L, B, D], [L, B], mask [L, B])``.

    The last global batch is padded (with sample 0) and the mask marks real samples, so accuracy
    covers the whole test set under any replication.
    """
    size = batch_size * replicas.total
    steps = -(-len(x) // size)
    padded = np.zeros(steps * size, np.int64)
    padded[:len(x)] = np.arange(len(x))
    real = np.arange(steps * size) < len(x)
    for k in range(steps):
        window = slice(k * size, (k + 1) * size)
        rows, mask = replicas.cut(padded[window]), replicas.cut(real[window])
        yield x[rows], y[rows], mask
