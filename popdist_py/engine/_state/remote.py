"""Remote buffers: per-replica off-chip storage (PopXL's ``remote_buffer``), in memory or in a file.

A :class:`RemoteBuffer` gives every local replica ``entries`` slots of one shape and dtype; a step
moves data between a slot and the replica with ``ops.remote_load``/``ops.remote_store``.
Variables can live in a slot (``rt.remote_variable``, ``rt.remote_replica_sharded_variable``),
which is how state that is rarely touched (optimizer state, the seed's W1) is kept out of the
working set. With ``location="file"`` the slots are a memory-mapped file (the "off-chip streaming
memory" of PopART's tensor locations): the kernel pages it in only while it is used and may
drop it again, so it does not count against the process's resident memory. Files are temporary:
they are deleted when the runtime closes (or is collected); the default spill directory of a
process that was killed is removed by the next runtime that spills on that machine. By default
they go to shared memory (``/dev/shm``: host RAM outside the process, as PopART's streaming
memory is, never written back to a disk), or to the temporary directory when shared memory has
no room; a file's space is reserved when it is made, so running out is an error then, not a
SIGBUS later.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import shutil
import socket
import tempfile
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from popcontract import settings
from popcontract.environment import REMOTE_DIR
from popdist_py import validate

if TYPE_CHECKING:  # pragma: no cover
    from popdist_py.engine._state.variables import Variable

log = logging.getLogger(__name__)

LOCATIONS = ("memory", "file")
#: Directory for file-backed buffers when neither ``path`` nor ``Runtime(remote_dir=...)`` is given.
REMOTE_DIR_ENV = REMOTE_DIR


def _shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"remote_buffer: shape must be a tuple of ints, got {shape!r}") from None
    return tuple(validate.non_negative(f"remote_buffer: shape[{k}]", d) for k, d in enumerate(dims))


class RemoteBuffer:
    """``entries`` slots of ``shape``/``dtype`` for each local replica of one runtime.

    Create with ``rt.remote_buffer``. ``location`` is ``"memory"`` or ``"file"`` (then ``path``
    is the backing file, deleted on close).
    """

    def __init__(self, name: str, shape: tuple[int, ...], dtype: np.dtype, entries: int, num_local_replicas: int,
                 location: str, path: Path | None) -> None:
        self.name = name
        self.shape = shape
        self.dtype = dtype
        self.entries = entries
        self.location = location
        self.path = path
        full = (num_local_replicas, entries, *shape)
        if location == "file" and math.prod(full) > 0:
            assert path is not None
            # r+: the file exists at its full size, its space reserved (w+ would truncate it, sparse again)
            self._data: np.ndarray = np.memmap(path, dtype=dtype, mode="r+", shape=full)
        else:
            self._data = np.zeros(full, dtype)  # calloc: pages are only committed when written
        self._bound: dict[int, Variable] = {}
        self._closed = False

    # -- slots ------------------------------------------------------------------------------------
    def check_offset(self, offset: Any, what: str) -> int:
        """``offset`` as an entry of this buffer; TypeError/ValueError naming ``what`` and the valid range."""
        return validate.index(f"{what}: offset", offset, f"remote buffer {self.name!r} with entries", self.entries)

    def slot(self, local_index: int, offset: int) -> np.ndarray:
        """The storage of one replica's entry ``offset`` (a view: writes go to the buffer)."""
        if self._closed:
            raise RuntimeError(f"remote buffer {self.name!r} is closed (its Runtime was closed)")
        return self._data[local_index, offset, ...]  # a view even for 0-d slots (not a scalar)

    def bind(self, offset: int, var: Variable) -> None:
        """Record that ``var`` lives in entry ``offset`` (one variable per entry)."""
        other = self._bound.get(offset)
        if other is not None:
            raise ValueError(
                f"remote buffer {self.name!r} entry {offset} already holds variable {other.name!r}; "
                f"free entries: {self.free_entries() or 'none'} (create the buffer with more entries)"
            )
        self._bound[offset] = var

    def unbind(self, offset: int) -> None:
        """Free entry ``offset`` again (a variable whose creation failed after :meth:`bind`)."""
        self._bound.pop(offset, None)

    def variable_at(self, offset: int) -> Variable | None:
        return self._bound.get(offset)

    def free_entries(self) -> list[int]:
        return [i for i in range(self.entries) if i not in self._bound]

    def bound_entries(self) -> list[int]:
        return sorted(self._bound)

    def check_value(self, x: Any, what: str) -> np.ndarray:
        """``x`` as an array of the buffer's shape and dtype; TypeError/ValueError naming both."""
        if isinstance(x, np.ndarray):
            if x.dtype != self.dtype:
                raise TypeError(f"{what}: value has dtype {x.dtype} but remote buffer {self.name!r} holds {self.dtype}")
            arr = x
        else:
            arr = np.asarray(x, dtype=self.dtype)
        if arr.shape != self.shape:
            raise ValueError(
                f"{what}: value has shape {arr.shape} but remote buffer {self.name!r} has slots of shape {self.shape}"
            )
        return arr

    @property
    def nbytes(self) -> int:
        """Bytes of all slots of all local replicas."""
        return int(self._data.nbytes)

    @property
    def entry_nbytes(self) -> int:
        """Bytes of one entry over all local replicas (0 once closed)."""
        rows: int = self._data.shape[0]
        return rows * math.prod(self.shape) * self.dtype.itemsize

    @property
    def is_memory_mapped(self) -> bool:
        """Whether the slots are a memory-mapped file (``location="file"``, not empty, not closed)."""
        return isinstance(self._data, np.memmap)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Drop the map (it is unmapped when the last view goes); the file can be unlinked at once (POSIX).
        self._data = np.zeros((0,), self.dtype)
        if self.path is not None:
            try:
                self.path.unlink(missing_ok=True)
            except OSError:  # pragma: no cover - best effort
                log.debug("could not remove %s", self.path, exc_info=True)

    def __repr__(self) -> str:
        where = self.location if self.path is None else f"file {self.path}"
        return (f"RemoteBuffer(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, "
                f"entries={self.entries}, location={where})")


class RemoteSlots:
    """Variable storage in slot ``offset`` of a remote buffer (one per local replica)."""

    __slots__ = ("buffer", "offset")

    def __init__(self, buffer: RemoteBuffer, offset: int) -> None:
        self.buffer = buffer
        self.offset = offset

    def get(self, local_index: int) -> np.ndarray:
        return self.buffer.slot(local_index, self.offset)

    def put(self, local_index: int, value: np.ndarray) -> None:
        np.copyto(self.buffer.slot(local_index, self.offset), value)

    def nbytes(self) -> tuple[int, int]:
        size = self.buffer.entry_nbytes
        return (0, size) if self.buffer.location == "file" else (size, 0)


_PREFIX = "popdist-remote-"


_ORPHAN = re.compile(rf"^{_PREFIX}(?P<host>.+)-p(?P<pid>\d+)-i\d+-\w+$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


#: Linux's shared memory, a tmpfs.
SHARED_MEMORY_DIR = "/dev/shm"


def _parents() -> list[Path]:
    """Where default spill directories go, best first: shared memory (``/dev/shm``, a tmpfs: host
    RAM outside the process, as PopART's streaming memory is, with no writeback to a disk), then
    the temporary directory."""
    shm = Path(SHARED_MEMORY_DIR)
    parents = [shm] if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else []
    return [*parents, Path(tempfile.gettempdir())]


def _remove_orphans() -> None:
    """Delete default spill directories left on this host by processes that died without closing
    (SIGKILL, a crash), so killed jobs do not fill shared memory or the temporary directory."""
    host = socket.gethostname()
    for d in (d for parent in _parents() for d in parent.glob(f"{_PREFIX}*")):
        m = _ORPHAN.match(d.name)
        try:
            if m is None or m["host"] != host or d.stat().st_uid != os.getuid() or _alive(int(m["pid"])):
                continue
        except OSError:
            continue
        log.debug("removing %s, left by process %s", d, m["pid"])
        shutil.rmtree(d, ignore_errors=True)


def _cleanup(buffers: list[RemoteBuffer], tmpdir: list[str]) -> None:
    for b in buffers:
        b.close()
    for d in tmpdir:
        shutil.rmtree(d, ignore_errors=True)


def _existing_dir(d: Path, what: str) -> Path:
    """``d``, which must be an existing directory: it is never created (a typo would silently
    become a new directory tree)."""
    if not d.is_dir():
        state = "is not a directory" if d.exists() else "does not exist"
        raise FileNotFoundError(f"{what}: directory {str(d)!r} {state} (create it first)")
    return d


class RemoteBuffers:
    """The remote buffers of one runtime and the directory their files go to."""

    def __init__(self, num_local_replicas: int, instance: int, directory: str | os.PathLike[str] | None) -> None:
        self.num_local_replicas = num_local_replicas
        self.instance = instance
        self.directory = (_existing_dir(Path(directory), "Runtime(remote_dir=...)")
                          if directory is not None else None)
        self.buffers: list[RemoteBuffer] = []
        self._tmpdir: list[str] = []  # created by us, removed on close
        self._tmpdirs: dict[int, str] = {}  # the same, by their parent's place in _parents()
        self._finalizer = weakref.finalize(self, _cleanup, self.buffers, self._tmpdir)

    def _dir(self, path: str | os.PathLike[str] | None) -> Path:
        if path is not None:
            return _existing_dir(Path(path), "remote_buffer(path=...)")
        if self.directory is not None:
            return _existing_dir(self.directory, "Runtime(remote_dir=...)")
        if chosen := settings.text(REMOTE_DIR_ENV):
            return _existing_dir(Path(chosen), f"${REMOTE_DIR_ENV}")
        return self._default_dir(0)

    def _default_dir(self, choice: int) -> Path:
        """The private spill directory in the ``choice``-th of :func:`_parents` (made on first use)."""
        parents = _parents()
        choice = min(choice, len(parents) - 1)
        if not self._tmpdirs:
            _remove_orphans()
        if choice not in self._tmpdirs:
            prefix = f"{_PREFIX}{socket.gethostname()}-p{os.getpid()}-i{self.instance}-"
            made = tempfile.mkdtemp(prefix=prefix, dir=parents[choice])
            self._tmpdirs[choice] = made
            self._tmpdir.append(made)
        return Path(self._tmpdirs[choice])

    def _file(self, name: str, nbytes: int, path: str | os.PathLike[str] | None) -> Path:
        """A new backing file of ``nbytes``, its space reserved now (a sparse file that runs out of
        space later kills the process with SIGBUS on a write). The default directory in shared
        memory gives way to the temporary directory when shared memory has no room."""
        chosen = path is not None or self.directory is not None or bool(settings.text(REMOTE_DIR_ENV))
        choice = 0
        while True:
            where = self._dir(path) if chosen else self._default_dir(choice)
            fd, tmp = tempfile.mkstemp(prefix=f"{name}.i{self.instance}.", suffix=".bin", dir=where)
            try:
                if nbytes:
                    os.posix_fallocate(fd, 0, nbytes)
                return Path(tmp)
            except OSError as e:
                os.unlink(tmp)
                if e.errno != errno.ENOSPC:
                    raise
                free = shutil.disk_usage(where).free
                if chosen or choice + 1 >= len(_parents()):
                    raise OSError(errno.ENOSPC, f"remote_buffer: no room for {nbytes} bytes in {str(where)!r} "
                                                f"({free} bytes free); give remote_dir or ${REMOTE_DIR_ENV} a "
                                                "directory with room") from None
                log.info("remote buffers: %s has %d bytes free, %d needed; spilling to %s instead",
                         where, free, nbytes, _parents()[choice + 1])
                choice += 1
            finally:
                os.close(fd)

    def create(self, shape: Any, dtype: Any, entries: int, location: str, path: str | os.PathLike[str] | None
               ) -> RemoteBuffer:
        dims = _shape(shape)
        dt = np.dtype(dtype)
        if dt.hasobject or dt.fields is not None or dt.kind in "SUVMm":
            raise TypeError(f"remote_buffer: dtype {dt} is not supported (use a numeric or bool dtype)")
        entries = validate.count("remote_buffer: entries", entries)
        if location not in LOCATIONS:
            valid = ", ".join(map(repr, LOCATIONS))
            raise ValueError(f"remote_buffer: location={location!r} is invalid: use one of {valid}")
        if path is not None and location != "file":
            raise ValueError(f"remote_buffer: path={str(path)!r} is only used with location='file'")
        name = f"remote_buffer_{len(self.buffers)}"
        file = None
        if location == "file":
            nbytes = self.num_local_replicas * entries * math.prod(dims) * dt.itemsize
            file = self._file(name, nbytes, path)
        try:
            buf = RemoteBuffer(name, dims, dt, entries, self.num_local_replicas, location, file)
        except BaseException:
            if file is not None:
                file.unlink(missing_ok=True)
            raise
        self.buffers.append(buf)
        log.debug("created %r", buf)
        return buf

    def owns(self, buf: Any) -> bool:
        return isinstance(buf, RemoteBuffer) and any(b is buf for b in self.buffers)

    def close(self) -> None:
        self._finalizer()


__all__ = ["LOCATIONS", "REMOTE_DIR_ENV", "RemoteBuffer", "RemoteBuffers", "RemoteSlots"]
