"""The IDX format of the MNIST files, read with validation so a bad download fails loudly.

An IDX file is a 4-byte magic number (two zero bytes, a type code, the number of dimensions),
one big-endian uint32 per dimension, then the data in C order, big-endian. MNIST images are
``2051`` (unsigned bytes, 3 dimensions: count x rows x cols), labels ``2049`` (unsigned bytes,
1 dimension). Files may be gzipped (``.gz``), as they are distributed.

Every problem raises :class:`IdxError` (a ``ValueError``) whose message starts with the file's
path and says what is wrong; a missing file raises ``FileNotFoundError`` naming every path tried.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049

#: IDX type code -> big-endian numpy dtype.
DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_CODES = {dt.newbyteorder("="): code for code, dt in DTYPES.items()}


class IdxError(ValueError):
    """A malformed IDX file; the message names the file and the problem."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem


def find(directory: Path | str, name: str) -> Path:
    """``directory/name``, else ``directory/name.gz``; FileNotFoundError naming both if neither exists."""
    plain = Path(directory) / name
    for candidate in (plain, plain.with_name(plain.name + ".gz")):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"MNIST file {plain} not found (nor {plain.name}.gz in {plain.parent})")


def _read_bytes(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"MNIST file {path} not found") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise IdxError(path, f"not a valid gzip file ({exc or type(exc).__name__})") from None


def read_idx(path: Path | str, magic: int | None = None) -> np.ndarray:
    """The array stored in an IDX file (native byte order); ``magic`` checks the file's kind."""
    path = Path(path)
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise IdxError(path, f"truncated header: the file has {len(raw)} bytes, an IDX header needs at least 4")
    (found,) = struct.unpack(">I", raw[:4])
    if magic is not None and found != magic:
        raise IdxError(path, f"bad magic number {found} (0x{found:08X}); expected {magic} (0x{magic:08X}) "
                             f"for MNIST {_kind(magic)}")
    zero, code, ndim = found >> 16, (found >> 8) & 0xFF, found & 0xFF
    if zero != 0 or code not in DTYPES:
        raise IdxError(path, f"bad magic number {found} (0x{found:08X}): not an IDX file")
    if ndim == 0:
        raise IdxError(path, "the header declares 0 dimensions")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IdxError(path, f"truncated header: {ndim} dimensions need {header} bytes, the file has {len(raw)}")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = DTYPES[code]
    expected = header + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "has trailing data"
        raise IdxError(path, f"{what}: the header declares dimensions {' x '.join(map(str, dims))} of "
                             f"{dtype.itemsize}-byte values, i.e. {expected} bytes, but the file has {len(raw)}")
    data = np.frombuffer(raw, dtype, offset=header).reshape(dims)
    return data.astype(dtype.newbyteorder("="))


def _kind(magic: int) -> str:
    return {IMAGES_MAGIC: "images", LABELS_MAGIC: "labels"}.get(magic, "IDX")


def read_images(path: Path | str) -> np.ndarray:
    """uint8 images ``[count, rows, cols]`` from an MNIST images file (magic 2051)."""
    images = read_idx(path, IMAGES_MAGIC)
    if images.ndim != 3:  # guaranteed by the magic number; kept for clarity
        raise IdxError(path, f"images need 3 dimensions (count x rows x cols), found {images.ndim}")
    count, rows, cols = images.shape
    if count == 0 or rows == 0 or cols == 0:
        raise IdxError(path, f"dimensions {count} x {rows} x {cols} hold no images (every dimension must be > 0)")
    return images


def read_labels(path: Path | str, num_classes: int = 10) -> np.ndarray:
    """uint8 labels ``[count]`` from an MNIST labels file (magic 2049), each below ``num_classes``."""
    labels = read_idx(path, LABELS_MAGIC)
    if labels.size == 0:
        raise IdxError(path, "the file holds no labels")
    if labels.max() >= num_classes:
        bad = int(np.argmax(labels >= num_classes))
        raise IdxError(path, f"label {int(labels[bad])} at index {bad} is out of range: "
                             f"labels must be 0..{num_classes - 1}")
    return labels


def read_pair(images_path: Path | str, labels_path: Path | str) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels that belong together: the counts must match."""
    images, labels = read_images(images_path), read_labels(labels_path)
    if len(images) != len(labels):
        raise IdxError(labels_path, f"has {len(labels)} labels but {images_path} has {len(images)} images; "
                                    "the counts must match")
    return images, labels


def write_idx(path: Path | str, array: np.ndarray) -> Path:
    """Write ``array`` as an IDX file (gzipped when the name ends in ``.gz``); the inverse of ``read_idx``."""
    path = Path(path)
    array = np.asarray(array)
    code = _CODES.get(array.dtype.newbyteorder("="))
    if code is None:
        raise TypeError(f"IDX cannot store dtype {array.dtype}; use one of {', '.join(str(d) for d in _CODES)}")
    if not 1 <= array.ndim <= 255:
        raise ValueError(f"IDX stores 1 to 255 dimensions, got an array of shape {array.shape}")
    body = struct.pack(f">I{array.ndim}I", (code << 8) | array.ndim, *array.shape)
    body += np.ascontiguousarray(array, DTYPES[code]).tobytes()
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as f:
            f.write(body)
    else:
        path.write_bytes(body)
    return path
