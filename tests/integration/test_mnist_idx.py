"""The MNIST example's IDX loader on real files: round trips, gzip, and every kind of corruption."""

from __future__ import annotations

import gzip
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import PYTHON, ROOT

sys.path.insert(0, str(ROOT / "examples"))

from mnist import datasets, idx
from mnist.idx import IdxError

SCRIPT = ROOT / "examples" / "mnist_rts.py"


def idx_bytes(magic: int, dims: tuple[int, ...], payload: bytes) -> bytes:
    """An IDX file written by hand (big-endian header), independent of ``idx.write_idx``."""
    return struct.pack(f">I{len(dims)}I", magic, *dims) + payload


def fake_mnist(directory: Path, n_train: int = 40, n_test: int = 12, size: int = 10, gz: bool = False,
               seed: int = 0) -> tuple[np.ndarray, ...]:
    """Four real-format MNIST files: class k images have a bright row k (learnable)."""
    rng = np.random.default_rng(seed)
    arrays = []
    suffix = ".gz" if gz else ""
    for (images_name, labels_name), n in zip(datasets.MNIST_FILES.values(), (n_train, n_test), strict=True):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = rng.integers(0, 60, (n, size, size)).astype(np.uint8)
        images[np.arange(n), labels] = 255
        for name, array, magic in ((images_name, images, 2051), (labels_name, labels, 2049)):
            raw = idx_bytes(magic, array.shape, array.tobytes())
            path = directory / (name + suffix)
            if gz:
                with gzip.open(path, "wb") as f:
                    f.write(raw)
            else:
                path.write_bytes(raw)
        arrays += [images, labels]
    return tuple(arrays)


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_files_read_back(tmp_path: Path, gz: bool) -> None:
    train_images, train_labels, _test_images, test_labels = fake_mnist(tmp_path, gz=gz)
    data = datasets.load_mnist(tmp_path)
    assert data.train_x.shape == (40, 100) and data.test_x.shape == (12, 100)
    assert data.train_x.dtype == np.float32 and data.train_x.min() >= 0.0 and data.train_x.max() == 1.0
    np.testing.assert_array_equal(data.train_x, train_images.reshape(40, -1) / np.float32(255))
    np.testing.assert_array_equal(data.train_y, train_labels)
    np.testing.assert_array_equal(data.test_y, test_labels)
    assert data.input_size == 100


@pytest.mark.parametrize("dtype", ["u1", "i1", ">i2", ">i4", ">f4", ">f8"])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_write_read_round_trip(tmp_path: Path, dtype: str, suffix: str) -> None:
    array = (np.arange(60).reshape(3, 4, 5) - 7).astype(np.dtype(dtype).newbyteorder("="))
    if array.dtype.kind == "u":
        array = np.abs(array)
    path = idx.write_idx(tmp_path / f"a.idx{suffix}", array)
    back = idx.read_idx(path)
    assert back.dtype == array.dtype and back.dtype.isnative
    np.testing.assert_array_equal(back, array)


def test_header_is_big_endian(tmp_path: Path) -> None:
    path = idx.write_idx(tmp_path / "labels", np.array([1, 2, 3], np.uint8))
    assert path.read_bytes() == bytes([0, 0, 8, 1, 0, 0, 0, 3, 1, 2, 3])


def test_plain_file_wins_over_gz(tmp_path: Path) -> None:
    idx.write_idx(tmp_path / "x", np.array([1], np.uint8))
    idx.write_idx(tmp_path / "x.gz", np.array([2], np.uint8))
    assert idx.find(tmp_path, "x") == tmp_path / "x"
    (tmp_path / "x").unlink()
    assert idx.find(tmp_path, "x") == tmp_path / "x.gz"


def corrupt(tmp_path: Path, name: str, raw: bytes, gz: bool = False) -> Path:
    """fake_mnist files with ``name`` replaced by ``raw``."""
    fake_mnist(tmp_path)
    path = tmp_path / name
    if gz:
        path.unlink()
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as f:
            f.write(raw)
    else:
        path.write_bytes(raw)
    return path


TRAIN_IMAGES, TRAIN_LABELS = datasets.MNIST_FILES["train"]
TEST_IMAGES, TEST_LABELS = datasets.MNIST_FILES["test"]
GOOD_IMAGES = idx_bytes(2051, (40, 10, 10), bytes(40 * 100))

CASES = {
    "bad magic": (TRAIN_IMAGES, idx_bytes(2049, (40, 10, 10), bytes(40 * 100)), "bad magic number 2049"),
    "labels magic in images file": (TRAIN_LABELS, idx_bytes(2051, (40,), bytes(40)), "expected 2049"),
    "not idx at all": (TEST_IMAGES, b"<html>not found</html>", "bad magic number"),
    "empty file": (TEST_LABELS, b"", "truncated header"),
    "truncated header": (TRAIN_IMAGES, struct.pack(">II", 2051, 40), "truncated header"),
    "truncated data": (TRAIN_IMAGES, GOOD_IMAGES[:-10], "truncated"),
    "trailing data": (TRAIN_IMAGES, GOOD_IMAGES + b"\0\0", "trailing data"),
    "zero rows": (TRAIN_IMAGES, idx_bytes(2051, (40, 0, 10), b""), "hold no images"),
    "label count mismatch": (TRAIN_LABELS, idx_bytes(2049, (39,), bytes(39)), "39 labels"),
    "label out of range": (TEST_LABELS, idx_bytes(2049, (12,), bytes([3] * 11 + [10])), "label 10 at index 11"),
    "test image size differs": (TEST_IMAGES, idx_bytes(2051, (12, 5, 5), bytes(12 * 25)), "must match"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("gz", [False, True])
def test_corrupt_files_name_file_and_problem(tmp_path: Path, case: str, gz: bool) -> None:
    name, raw, problem = CASES[case]
    path = corrupt(tmp_path, name, raw, gz)
    with pytest.raises(IdxError) as info:
        datasets.load_mnist(tmp_path)
    assert str(path) in str(info.value), info.value
    assert problem in str(info.value), info.value


def test_broken_gzip_names_file(tmp_path: Path) -> None:
    fake_mnist(tmp_path)
    (tmp_path / TRAIN_LABELS).unlink()
    path = tmp_path / (TRAIN_LABELS + ".gz")
    path.write_bytes(gzip.compress(idx_bytes(2049, (40,), bytes(40)))[:-12])
    with pytest.raises(IdxError, match="not a valid gzip file") as info:
        datasets.load_mnist(tmp_path)
    assert str(path) in str(info.value)


def test_missing_file_names_both_candidates(tmp_path: Path) -> None:
    fake_mnist(tmp_path)
    (tmp_path / TEST_LABELS).unlink()
    with pytest.raises(FileNotFoundError) as info:
        datasets.load_mnist(tmp_path)
    assert str(tmp_path / TEST_LABELS) in str(info.value) and f"{TEST_LABELS}.gz" in str(info.value)


@pytest.mark.slow  # starts the example
def test_cli_reports_bad_data_in_one_line(tmp_path: Path) -> None:
    path = corrupt(tmp_path, TRAIN_IMAGES, GOOD_IMAGES[:-1])
    proc = subprocess.run([PYTHON, str(SCRIPT), "--data-dir", str(tmp_path), "--epochs", "1"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert f"error: {path}: truncated" in proc.stderr


@pytest.mark.slow  # starts the example and trains
def test_cli_trains_on_idx_files(tmp_path: Path) -> None:
    fake_mnist(tmp_path, n_train=200, n_test=50, gz=True)
    proc = subprocess.run([PYTHON, str(SCRIPT), "--data-dir", str(tmp_path), "--epochs", "3",
                           "--replication-factor", "2", "--batch-size", "5", "--lr", "0.5"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("final: test_accuracy=")
    assert float(last.split()[1].split("=")[1]) >= 0.9, proc.stdout
