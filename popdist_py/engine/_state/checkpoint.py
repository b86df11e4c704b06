"""Checkpoints of a runtime's variables that restore under any replica/instance split.

Format: a standard ``.npz`` (a zip of ``.npy`` files, readable with ``numpy.load(path,
allow_pickle=False)``): member ``__manifest__`` is a 0-d unicode array holding JSON (format,
version, replication factor and instances of the saver, the caller's metadata, and per variable
its name, member key, per-group shape, dtype, replica grouping, retrieval mode, RTS and remote
placement); every variable is one member holding its *full host tensor* (``shape_on_host``: a
leading group axis when there are several groups; shards joined and un-padded; remote slots
read back). A variable with ``retrieval_mode="all_replicas"`` whose groups have several members
is stored per replica, ``(R, *shape)``, so replicas that diverged are kept. Nothing is pickled.

Saving is collective: every instance takes part in gathering each variable to instance 0, which
alone writes, one variable at a time (memory: one full tensor at a time), into a temporary file
in the target's directory that is fsynced and renamed over the target, so a crash mid-write
leaves the previous checkpoint intact. Loading is collective too: instance 0 reads and checks
the file (manifest, every member's CRC and header) before anything is changed, then broadcasts
each tensor and every instance loads its replicas (their shards, their remote slots). Shapes,
dtypes, names and groupings are checked with errors naming the values; the file is read only
by instance 0, so it need not be visible to the other hosts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from popdist_py.engine._placement.grouping import ReplicaGrouping
from popdist_py.engine._placement.replicas import ReplicaPlacement
from popdist_py.engine._state.variables import Variable, collect, host_value, per_group_values
from popdist_py.engine.errors import CheckpointError

if TYPE_CHECKING:  # pragma: no cover
    from popdist_py.engine._collectives.transport import Transport

log = logging.getLogger(__name__)

FORMAT = "poprun-py engine checkpoint"
VERSION = 1
MANIFEST = "__manifest__"
#: Broadcast large tensors in pieces of this many bytes (MPI counts are C ints).
_BCAST_CHUNK = 1 << 30


def _per_replica(v: Variable) -> bool:
    return v.retrieval_mode == "all_replicas" and v.replica_grouping.group_size > 1


def _entry(v: Variable, key: str) -> dict[str, Any]:
    g = v.replica_grouping
    host = (g.num_replicas, *v.shape) if _per_replica(v) else v.shape_on_host
    return {
        "name": v.name,
        "key": key,
        "shape": list(v.shape),
        "host_shape": list(host),
        "dtype": v.dtype.str,
        "replica_grouping": {"num_replicas": g.num_replicas, "stride": g.stride, "group_size": g.group_size,
                             **({"assignment": list(g.irregular)} if g.irregular is not None else {})},
        "num_groups": g.num_groups,
        "retrieval_mode": v.retrieval_mode,
        "per_replica": _per_replica(v),
        "sharded": None if v.sharding is None else {"shard_over": v.sharding.domain.group_size},
        "remote": None if not v.is_remote else {"buffer": v.remote_buffer.name, "offset": v.remote_offset,
                                                 "location": v.remote_buffer.location},
    }


def _signature(variables: Sequence[Variable]) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    return tuple((v.name, v.shape, v.dtype.str) for v in variables)


def _agree(transport: Transport | None, what: str, variables: Sequence[Variable]) -> None:
    if transport is not None:
        sig = _signature(variables)
        digest = hashlib.blake2b(repr(sig).encode(), digest_size=8).hexdigest()  # hash() differs per process
        transport.agree(what, (len(sig), digest), ("variables", "variables digest"))


def _status(transport: Transport | None, error: str | None, what: str) -> str | None:
    """Instance 0's error (or None) on every instance."""
    if transport is None:
        return error
    text = transport.bcast_bytes((error or "").encode(), 0, what).decode()
    return text or None


# -- save ----------------------------------------------------------------------------------------


class _Writer:
    """The temporary zip on instance 0; remembers the first error instead of raising it mid-collective."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.error: str | None = None
        self.tmp: Path | None = None
        self.file: IO[bytes] | None = None
        self.zip: zipfile.ZipFile | None = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            self.tmp = Path(tmp)
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would hide the checkpoint from other users
            self.file = os.fdopen(fd, "wb")
            self.zip = zipfile.ZipFile(self.file, "w", zipfile.ZIP_STORED, allowZip64=True)
        except Exception as exc:
            self.fail(exc, "could not create a temporary file next to it")

    def fail(self, exc: BaseException, doing: str) -> None:
        if self.error is None:
            self.error = f"saving checkpoint {self.path}: {doing}: {type(exc).__name__}: {exc}"
            log.error("%s", self.error)

    def add(self, key: str, arr: np.ndarray) -> None:
        if self.error is not None or self.zip is None:
            return
        try:
            with self.zip.open(key + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, arr, allow_pickle=False)
        except Exception as exc:
            self.fail(exc, f"could not write {key}")

    def commit(self, manifest: dict[str, Any]) -> None:
        if self.error is None:
            try:
                self.add(MANIFEST, np.array(json.dumps(manifest)))
                assert self.zip is not None and self.file is not None
                self.zip.close()
                self.file.flush()
                os.fsync(self.file.fileno())
                self.file.close()
                if self.error is None:
                    os.replace(self.tmp, self.path)  # type: ignore[arg-type]
                    self.tmp = None
                    _fsync_dir(self.path.parent)
            except Exception as exc:
                self.fail(exc, "could not complete the file")
        self.cleanup()

    def cleanup(self) -> None:
        for closer in (self.zip, self.file):
            try:
                if closer is not None:
                    closer.close()
            except Exception:  # pragma: no cover - already failing
                pass
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
            self.tmp = None


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def save(
    variables: Iterable[Variable],
    placement: ReplicaPlacement,
    transport: Transport | None,
    path: str | os.PathLike[str],
    metadata: dict[str, Any] | None = None,
) -> None:
    """Write every variable's full host tensor to ``path`` (see the module docstring). Collective."""
    vs = list(variables)
    path = Path(os.fspath(path))
    what = f"save({str(path)!r})"
    try:  # checked on every instance (all pass the same metadata) before anything is collective
        json.dumps(metadata or {}, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what}: metadata must be JSON-serialisable (str keys, numbers, strings, lists, "
                        f"dicts): {exc}") from None
    _agree(transport, what, vs)
    writer = _Writer(path) if placement.instance == 0 else None
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "replication_factor": placement.replication_factor,
        "num_instances": placement.num_instances,
        "metadata": metadata or {},
        "variables": [],
    }
    for i, v in enumerate(vs):
        key = f"v{i}"
        # diverged replicas are kept: one value per replica
        arr = _all_replicas(v, placement, transport) if _per_replica(v) else host_value(v, placement, transport, root=0)
        if writer is not None:
            assert arr is not None
            manifest["variables"].append(_entry(v, key))
            writer.add(key, arr)
        del arr  # one full tensor at a time
    if writer is not None:
        writer.commit(manifest)
        if writer.error is None:
            log.info("saved %d variable(s) to %s", len(vs), path)
    error = _status(transport, writer.error if writer is not None else None, what)
    if error:
        raise OSError(error)


def _all_replicas(v: Variable, placement: ReplicaPlacement, transport: Transport | None) -> np.ndarray | None:
    R = placement.replication_factor
    if transport is not None:
        transport.agree(f"save {v.name!r}", (v.name, v.shape), ("variable", "shape"))
    return collect(placement, transport, range(R), v.local_value, v.shape, v.dtype, f"save {v.name!r}", root=0)


# -- load ----------------------------------------------------------------------------------------


def _ints(value: Any, what: str, path: Path) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise CheckpointError(f"{path}: the manifest's {what} is not a list of sizes: {value!r}")
    return value


def _check_entry(e: Any, path: Path) -> None:
    """A manifest entry has every field, of the right type (the file may be damaged or forged)."""
    if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not isinstance(e.get("key"), str):
        raise CheckpointError(f"{path}: malformed variable entry in the manifest: {e!r}")
    what = f"entry for {e['name']!r}"
    _ints(e.get("shape"), f"{what} shape", path)
    _ints(e.get("host_shape"), f"{what} host_shape", path)
    rg = e.get("replica_grouping")
    fields = ("num_replicas", "stride", "group_size")
    if not isinstance(rg, dict) or not all(isinstance(rg.get(k), int) for k in fields):
        raise CheckpointError(f"{path}: {what} has a malformed replica_grouping: {rg!r}")
    try:
        saved = _saved_grouping(rg)
        if saved.num_replicas != rg["num_replicas"] or saved.group_size != rg["group_size"]:
            raise ValueError(f"its assignment {rg.get('assignment')!r} does not fit its sizes")
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {what} has an invalid replica_grouping: {exc}") from None
    if not isinstance(e.get("num_groups"), int) or not isinstance(e.get("per_replica"), bool) \
            or e.get("retrieval_mode") not in ("one_per_group", "all_replicas") or not isinstance(e.get("dtype"), str):
        raise CheckpointError(f"{path}: {what} is malformed: {e!r}")
    groups = rg["num_replicas"] // rg["group_size"]
    lead = [rg["num_replicas"]] if e["per_replica"] else [groups] if groups > 1 else []
    if e["num_groups"] != groups or e["host_shape"] != lead + e["shape"]:
        raise CheckpointError(f"{path}: {what} is inconsistent: host_shape {e['host_shape']} does not fit shape "
                              f"{e['shape']} with {groups} group(s)")


def _read_manifest(zf: zipfile.ZipFile, path: Path) -> dict[str, Any]:
    names = set(zf.namelist())
    if MANIFEST + ".npy" not in names:
        raise CheckpointError(f"{path} is not a poprun-py checkpoint: it has no {MANIFEST} member "
                              f"(members: {', '.join(sorted(names)[:8]) or 'none'})")
    with zf.open(MANIFEST + ".npy") as f:
        raw = np.lib.format.read_array(f, allow_pickle=False)
    try:
        if raw.shape != () or raw.dtype.kind != "U":
            raise ValueError(f"a {raw.dtype} array of shape {raw.shape}, not a 0-d string")
        manifest = json.loads(str(raw[()]))
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: the manifest is not valid JSON ({exc})") from None
    found = manifest.get("format") if isinstance(manifest, dict) else manifest
    if found != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {found!r}; expected {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint version {manifest.get('version')!r} is not supported "
                              f"(this engine reads version {VERSION})")
    entries = manifest.get("variables")
    if not isinstance(entries, list):
        raise CheckpointError(f"{path}: the manifest has no variable list")
    seen: set[str] = set()
    for e in entries:
        _check_entry(e, path)
        if e["name"] in seen:
            raise CheckpointError(f"{path}: the manifest lists variable {e['name']!r} twice")
        seen.add(e["name"])
        key = e["key"]
        if key + ".npy" not in names:
            raise CheckpointError(f"{path}: variable {e.get('name') if isinstance(e, dict) else e!r} has no data "
                                  f"member {key!r}")
        with zf.open(key + ".npy") as f:
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read_header(f)
        if list(shape) != e.get("host_shape") or dtype.str != e.get("dtype") or dtype.hasobject:
            raise CheckpointError(
                f"{path}: the data of variable {e.get('name')!r} has shape {tuple(shape)} and dtype {dtype} but the "
                f"manifest says {tuple(e.get('host_shape') or ())} and {e.get('dtype')}: the file is inconsistent"
            )
    checked: dict[str, Any] = manifest  # a dict: its format and version were found above
    return checked


def _open_checked(path: Path) -> tuple[zipfile.ZipFile, dict[str, Any]]:
    """Open ``path`` and check it completely (structure, CRCs, headers) before anything is loaded."""
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        zf = zipfile.ZipFile(path, "r")
    except (zipfile.BadZipFile, OSError) as exc:
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupted?): {exc}") from None
    try:
        bad = zf.testzip()
        if bad is not None:
            raise CheckpointError(f"{path} is corrupted: member {bad!r} fails its CRC check")
        return zf, _read_manifest(zf, path)
    except CheckpointError:
        zf.close()
        raise
    except Exception as exc:  # zlib/zip/npy errors on damaged files
        zf.close()
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupted?): "
                              f"{type(exc).__name__}: {exc}") from None


def _match(path: Path, manifest: dict[str, Any], variables: Sequence[Variable], R: int, strict: bool
           ) -> list[tuple[Variable, dict[str, Any]]]:
    """Pair the runtime's variables with the checkpoint's; CheckpointError listing every problem."""
    saved = {e["name"]: e for e in manifest["variables"]}
    problems: list[str] = []
    missing = [v.name for v in variables if v.name not in saved]
    unexpected = [n for n in saved if n not in {v.name for v in variables}]
    if strict and (missing or unexpected):
        if missing:
            problems.append(f"missing from the checkpoint: {', '.join(map(repr, missing))}")
        if unexpected:
            problems.append(f"in the checkpoint but not in this runtime: {', '.join(map(repr, unexpected))} "
                            "(use strict=False to ignore)")
    pairs = []
    for v in variables:
        e = saved.get(v.name)
        if e is None:
            continue
        shape, dtype = tuple(e["shape"]), np.dtype(e["dtype"])
        if shape != v.shape:
            problems.append(f"{v.name!r} has shape {shape} in the checkpoint but {v.shape} here")
        if dtype != v.dtype:
            problems.append(f"{v.name!r} has dtype {dtype} in the checkpoint but {v.dtype} here")
        g, sg = v.replica_grouping, e["replica_grouping"]
        if e["num_groups"] != g.num_groups:
            problems.append(f"{v.name!r} has {e['num_groups']} replica group(s) in the checkpoint "
                            f"(stride={sg['stride']}, group_size={sg['group_size']} of {sg['num_replicas']} replicas) "
                            f"but {g.num_groups} here ({g})")
        elif sg["num_replicas"] == R and _saved_grouping(sg) != g:
            problems.append(f"{v.name!r} was saved with replica grouping {_saved_grouping(sg)} but here it is {g}")
        pairs.append((v, e))
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit this runtime: " + "; ".join(problems))
    return pairs


def _saved_grouping(sg: dict[str, Any]) -> ReplicaGrouping:
    """The grouping a manifest entry records: its assignment when irregular, else stride and size."""
    if "assignment" in sg:
        return ReplicaGrouping.from_assignments(sg["assignment"])
    return ReplicaGrouping.create(sg["num_replicas"], sg["stride"], sg["group_size"])


def _per_group(path: Path, v: Variable, e: dict[str, Any], arr: np.ndarray, R: int) -> np.ndarray | None:
    """A per-replica saved array as one value per group, or None to restore it replica by replica."""
    sg = e["replica_grouping"]
    g = v.replica_grouping
    saved = _saved_grouping(sg)
    if sg["num_replicas"] == R and saved == g and v.retrieval_mode == "all_replicas":
        return None
    values = []
    for grp in range(saved.num_groups):
        members = saved.members(grp)
        first = arr[members[0]]
        for m in members[1:]:
            if arr[m].tobytes() != first.tobytes():
                raise CheckpointError(
                    f"checkpoint {path}: variable {v.name!r} was saved per replica (retrieval_mode='all_replicas') "
                    f"and replicas {members[0]} and {m} of its group {grp} differ, so it can only be restored "
                    f"with replication_factor={sg['num_replicas']}, the same grouping and retrieval_mode='all_replicas'"
                )
        values.append(first)
    return np.stack(values) if saved.num_groups > 1 else values[0]


def _bcast_array(transport: Transport, arr: np.ndarray, what: str) -> None:
    flat = arr.reshape(-1).view(np.uint8)
    for lo in range(0, flat.size, _BCAST_CHUNK):
        transport.bcast(flat[lo : lo + _BCAST_CHUNK], 0, what)


def load(
    variables: Iterable[Variable],
    placement: ReplicaPlacement,
    transport: Transport | None,
    path: str | os.PathLike[str],
    strict: bool = True,
) -> dict[str, Any]:
    """Restore the variables from ``path``; returns the metadata given to :func:`save`. Collective."""
    vs = list(variables)
    path = Path(os.fspath(path))
    what = f"load({str(path)!r})"
    _agree(transport, what, vs)
    R = placement.replication_factor
    zf: zipfile.ZipFile | None = None
    error: str | None = None
    text = ""
    if placement.instance == 0:
        try:
            zf, manifest = _open_checked(path)
            text = json.dumps(manifest)
        except CheckpointError as exc:
            error = str(exc)
    try:
        if transport is not None:
            error = _status(transport, error, what)
            if error is None:
                text = transport.bcast_bytes(text.encode(), 0, what).decode()
        if error is not None:
            raise CheckpointError(error)
        manifest = json.loads(text)
        pairs = _match(path, manifest, vs, R, strict)  # the same verdict on every instance

        def fetch(v: Variable, e: dict[str, Any]) -> np.ndarray:
            host = np.empty(tuple(e["host_shape"]), np.dtype(e["dtype"]))
            if zf is not None:
                with zf.open(e["key"] + ".npy") as f:
                    host[...] = np.lib.format.read_array(f, allow_pickle=False)
            if transport is not None:
                _bcast_array(transport, host, f"{what}: {v.name!r}")
            return host

        # Per-replica values that must be regrouped are checked before any variable changes.
        staged: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}
        for v, e in pairs:
            if e["per_replica"]:
                host = fetch(v, e)
                staged[v.name] = (host, _per_group(path, v, e, host, R))
        for v, e in pairs:
            if v.name in staged:
                host, grouped = staged.pop(v.name)
                if grouped is None:  # same replicas, same grouping: replica by replica
                    for r in range(v.num_local_replicas):
                        v.set_local_value(r, host[placement.replica_index_offset + r])
                    continue
                host = grouped
            else:
                host = fetch(v, e)
            v.load_groups(per_group_values(host, v.replica_grouping, f"load {v.name!r}"))
            del host  # one full tensor at a time
        log.info("loaded %d variable(s) from %s (saved with %s replica(s) as %s instance(s))", len(pairs), path,
                 manifest.get("replication_factor"), manifest.get("num_instances"))
        return dict(manifest.get("metadata") or {})
    finally:
        if zf is not None:
            zf.close()


__all__ = ["FORMAT", "VERSION", "CheckpointError", "load", "save"]
