"""Real handwritten digits as MNIST's IDX files, where torchvision's ``datasets.MNIST(root)`` finds them.

Horovod's ``pytorch_mnist.py`` asks for MNIST with ``download=True``; torchvision downloads only when
one of ``root/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`` is missing (it checks that the
files exist, not their checksums). With no internet, those files are written here from the digits
scikit-learn ships (``load_digits``: 1,797 images of 8x8 at 0..16), laid out as MNIST lays out its
own: each digit scaled bilinearly to 20x20 and centred in 28x28, at 0..255.

    python -m bench.mnist_idx DIR
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt

#: MNIST's size and the box its digits are scaled into.
SIDE, BOX = 28, 20
#: The share of the digits kept for the test set.
TEST_FRACTION = 1 / 6
#: IDX's type code for unsigned bytes.
UBYTE = 0x08


def _bilinear(size: int, to: int) -> npt.NDArray[np.float64]:
    """The ``to x size`` matrix that resamples a row of ``size`` pixels to ``to``, pixel centres aligned."""
    centres = np.clip((np.arange(to) + 0.5) * size / to - 0.5, 0, size - 1)
    low = np.floor(centres).astype(int)
    high = np.minimum(low + 1, size - 1)
    weight = centres - low
    matrix = np.zeros((to, size))
    matrix[np.arange(to), low] += 1 - weight
    matrix[np.arange(to), high] += weight
    return matrix


def mnist_like(images: npt.NDArray[np.float64]) -> npt.NDArray[np.uint8]:
    """``images`` (n x h x w, 0 = background) as MNIST draws digits: BOX x BOX, centred in SIDE x SIDE, 0..255."""
    rows, cols = _bilinear(images.shape[1], BOX), _bilinear(images.shape[2], BOX)
    scaled = np.einsum("ih,nhw,jw->nij", rows, images, cols)
    out = np.zeros((len(images), SIDE, SIDE))
    margin = (SIDE - BOX) // 2
    out[:, margin:margin + BOX, margin:margin + BOX] = scaled * (255 / max(float(images.max()), 1e-12))
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def write_idx(path: Path, array: npt.NDArray[np.uint8]) -> None:
    """``array`` in IDX: zero, zero, the type, the number of dimensions, each dimension big-endian, the bytes."""
    header = struct.pack(">BBBB", 0, 0, UBYTE, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array).tobytes())


def write_mnist(root: Path, seed: int = 0) -> dict[str, int]:
    """Write the four files under ``root/MNIST/raw``; the number of train and test images."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = mnist_like(digits.images)
    labels = digits.target.astype(np.uint8)
    order = np.random.default_rng(seed).permutation(len(images))
    test = int(len(images) * TEST_FRACTION)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, picked in (("train", order[test:]), ("t10k", order[:test])):
        write_idx(raw / f"{split}-images-idx3-ubyte", images[picked])
        write_idx(raw / f"{split}-labels-idx1-ubyte", labels[picked])
    return {"train": len(images) - test, "test": test}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python -m bench.mnist_idx DIR\n{__doc__}")
    print(write_mnist(Path(sys.argv[1])))
