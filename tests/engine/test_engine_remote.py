"""Remote buffers in one process: per-replica slots, remote variables per replica and per group,
remote RTS variables, memory-mapped files, and errors that name the values."""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from popdist_py.engine import RemoteBuffer, Runtime, ShardArray, ops


def test_seed_listing_13_2_one_group_per_replica() -> None:
    """Two replicas, each its own group: each loads its own row, adds one, stores it back."""
    with Runtime(replication=2) as rt:
        v_h = np.arange(0, 2 * 32, dtype=np.int32).reshape(2, 32)
        rg = rt.replica_grouping(group_size=1)
        buf = rt.remote_buffer((32,), np.int32)
        remote_v = rt.remote_variable(v_h, buf, replica_grouping=rg)

        def step(ctx):  # type: ignore[no-untyped-def]
            v = ops.remote_load(buf, 0)
            v += 1
            ops.remote_store(buf, 0, v)
            return v

        out = rt.run(step)
        assert out.tolist() == (v_h + 1).tolist()
        assert rt.get_tensor_data(remote_v).tolist() == (v_h + 1).tolist()
        assert rt.get_replica_data(remote_v).tolist() == (v_h + 1).tolist()


def test_per_group_values_and_independent_replica_slots() -> None:
    with Runtime(replication=4) as rt:
        rg = rt.replica_grouping(group_size=2)  # {0, 1} and {2, 3}
        buf = rt.remote_buffer((3,), np.float64, entries=2)
        a = rt.remote_variable(np.array([[1.0, 2, 3], [4, 5, 6]]), buf, 0, replica_grouping=rg,
                               retrieval_mode="all_replicas", name="a")
        b = rt.remote_variable(np.full(3, 10.0), buf, 1, name="b")
        assert (a.is_remote, a.remote_buffer, a.remote_offset, b.remote_offset) == (True, buf, 0, 1)

        def step(ctx):  # type: ignore[no-untyped-def]
            x = ops.remote_load(buf, 0)
            ops.remote_store(buf, 0, x * (ctx.replica_index + 1))  # every replica its own slot
            y = ops.remote_load(buf, 1)
            ops.remote_store(buf, 1, y + ops.remote_load(buf, 0))
            return ops.remote_load(buf, 1)

        out = rt.run(step)
        assert rt.get_tensor_data(a).tolist() == [[1, 2, 3], [2, 4, 6], [12, 15, 18], [16, 20, 24]]
        assert out[3].tolist() == [26, 30, 34]
        assert rt.get_tensor_data(b).tolist() == [11, 12, 13]  # one_per_group: replica 0's slot
        rt.write_variable_data(a, np.zeros((2, 3)))
        assert rt.get_replica_data(a).sum() == 0
        assert rt.get_replica_data(b)[:, 0].tolist() == [11, 12, 22, 26]  # the other slot is untouched


def test_loads_are_private_copies_until_stored() -> None:
    with Runtime(replication=2) as rt:
        buf = rt.remote_buffer((2,), np.float32)
        v = rt.remote_variable(np.ones(2, np.float32), buf)

        def step(ctx):  # type: ignore[no-untyped-def]
            x = ops.remote_load(buf, 0)
            x[:] = 5  # not stored
            assert ctx[v].tolist() == [1, 1] and not ctx[v].flags.writeable
            ctx[v] = ctx[v] + 1  # ctx works on remote variables too
            return ops.remote_load(buf, 0)

        assert rt.run(step).tolist() == [[2, 2], [2, 2]]


@pytest.mark.parametrize("R", [2, 3, 4])
def test_remote_replica_sharded_variable(R: int) -> None:
    data = np.arange(1, 31, dtype=np.float32).reshape(5, 6)
    with Runtime(replication=R) as rt:
        s = ops.shard_size(data.shape, R)
        buf = rt.remote_buffer((s,), np.float32, entries=1)
        w = rt.remote_replica_sharded_variable(data, buf, 0, name="W1")
        assert w.is_sharded and w.is_remote and w.shape == (5, 6) and w.shape_on_replica == (s,)

        def step(ctx):  # type: ignore[no-untyped-def]
            shard = ops.remote_load(buf, 0)
            assert isinstance(shard, ShardArray) and shard.meta is not None and shard.meta.name == "W1"
            full = ops.replicated_all_gather(shard)
            ops.remote_store(buf, 0, shard - np.float32(1) * ops.replica_sharded_slice(full))
            return full

        full = rt.run(step)
        assert full.shape == (R, 5, 6) and all(np.array_equal(f, data) for f in full)
        assert np.array_equal(rt.get_tensor_data(w), np.zeros((5, 6)))  # w - 1 * w


def test_a_missing_directory_is_an_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "no" / "such"
    with pytest.raises(FileNotFoundError, match=rf"^Runtime\(remote_dir=\.\.\.\): directory '{missing}' does not "
                                                r"exist \(create it first\)$"):
        Runtime(replication=2, remote_dir=missing)
    (tmp_path / "file").write_text("")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        Runtime(replication=2, remote_dir=tmp_path / "file")
    monkeypatch.setenv("POPDIST_REMOTE_DIR", str(missing))
    with Runtime(replication=2) as rt:
        with pytest.raises(FileNotFoundError, match=rf"remote_buffer\(path=\.\.\.\): directory '{missing}'"):
            rt.remote_buffer((3,), np.float32, location="file", path=missing)
        with pytest.raises(FileNotFoundError, match=rf"^\$POPDIST_REMOTE_DIR: directory '{missing}' does not"):
            rt.remote_buffer((3,), np.float32, location="file")
    assert not (tmp_path / "no").exists()  # nothing was created


def test_file_backed_buffers_are_memory_mapped_and_removed(tmp_path: Path) -> None:
    (tmp_path / "spill").mkdir()
    (tmp_path / "elsewhere").mkdir()
    with Runtime(replication=2, remote_dir=tmp_path / "spill") as rt:
        buf = rt.remote_buffer((1000,), np.float32, entries=3, location="file")
        assert buf.location == "file" and buf.path is not None and buf.path.parent == tmp_path / "spill"
        assert buf.is_memory_mapped and buf.path.stat().st_size == 2 * 3 * 1000 * 4
        other = rt.remote_buffer((4,), np.int64, location="file", path=tmp_path / "elsewhere")
        assert other.path is not None and other.path.parent == tmp_path / "elsewhere"
        v = rt.remote_variable(np.arange(1000, dtype=np.float32), buf, 2)
        rt.run(lambda ctx: ops.remote_store(buf, 2, ops.remote_load(buf, 2) * 2))
        assert np.array_equal(rt.get_tensor_data(v), np.arange(1000) * 2)
        # the values are in the file, not in a private copy
        mapped = np.memmap(buf.path, np.float32, mode="r", shape=(2, 3, 1000))
        assert np.array_equal(mapped[1, 2], np.arange(1000) * 2) and not mapped[:, :2].any()
        del mapped
        assert rt.state_nbytes() == {"memory": 0, "file": 2 * 1000 * 4}
        path, other_path = buf.path, other.path
    assert not path.exists() and not other_path.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "spill"]  # our files only


def test_default_spill_directory_is_temporary() -> None:
    rt = Runtime(replication=2)
    buf = rt.remote_buffer((8,), np.float32, location="file")
    assert buf.path is not None
    directory = buf.path.parent
    assert directory.name.startswith("popdist-remote-") and buf.path.exists()
    rt.close()
    assert not directory.exists()
    rt = Runtime(replication=1)  # a runtime that is never closed cleans up when collected
    directory = rt.remote_buffer((8,), np.float32, location="file").path.parent  # type: ignore[union-attr]
    del rt
    gc.collect()
    assert not directory.exists()


def test_a_zero_dimensional_slot_is_a_view() -> None:
    with Runtime(replication=2) as rt:
        buf = rt.remote_buffer((), np.float32, entries=2, location="file")
        slot = buf.slot(1, 1)
        assert isinstance(slot, np.ndarray) and slot.shape == ()
        slot[...] = 4.5  # writes go to the buffer
        assert float(buf.slot(1, 1)) == 4.5 and float(buf.slot(0, 1)) == 0.0


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")
def test_default_spill_directory_is_in_shared_memory_with_its_space_reserved() -> None:
    with Runtime(replication=2) as rt:
        buf = rt.remote_buffer((1000,), np.float32, entries=3, location="file")
        assert buf.path is not None and buf.path.parent.parent == Path("/dev/shm")
        # reserved when made: the blocks exist before anything is written (not a sparse file)
        assert buf.path.stat().st_blocks * 512 >= 2 * 3 * 1000 * 4


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")
def test_a_buffer_larger_than_its_directory_is_refused_at_once(tmp_path: Path) -> None:
    import shutil

    room = Path(tempfile.mkdtemp(dir="/dev/shm"))
    too_big = shutil.disk_usage(room).total // 4 + (1 << 20)  # float32 elements: more bytes than the tmpfs has
    try:
        with Runtime(replication=1, remote_dir=room) as rt:
            with pytest.raises(OSError, match=rf"no room for {too_big * 4} bytes in '{room}'.*bytes free"):
                rt.remote_buffer((too_big,), np.float32, location="file")
            assert list(room.iterdir()) == []  # nothing left behind
    finally:
        room.rmdir()


@pytest.mark.slow  # starts a process (for a PID that has ended)
def test_spill_directories_of_dead_processes_are_removed() -> None:
    import socket
    import subprocess
    import tempfile

    gone = subprocess.Popen(["true"])  # a pid that has certainly exited
    gone.wait(timeout=10)
    host = socket.gethostname()
    orphan = Path(tempfile.mkdtemp(prefix=f"popdist-remote-{host}-p{gone.pid}-i0-"))
    (orphan / "remote_buffer_0.i0.x.bin").write_bytes(b"0" * 64)
    live = Path(tempfile.mkdtemp(prefix=f"popdist-remote-{host}-p{os.getpid()}-i0-"))
    other_host = Path(tempfile.mkdtemp(prefix=f"popdist-remote-elsewhere-p{gone.pid}-i0-"))
    try:
        with Runtime(replication=1) as rt:
            rt.remote_buffer((4,), np.float32, location="file")
        assert not orphan.exists() and live.exists() and other_host.exists()
    finally:
        for d in (orphan, live, other_host):
            if d.exists():
                for f in d.iterdir():
                    f.unlink()
                d.rmdir()


def test_errors_name_the_values() -> None:
    with Runtime(replication=2) as rt, Runtime(replication=2) as other:
        buf = rt.remote_buffer((3,), np.float32, entries=2)
        rt.remote_variable(np.zeros(3, np.float32), buf, 0, name="x")
        with pytest.raises(ValueError, match=r"remote_load\('remote_buffer_0', 2\) in replica 0: offset=2 is outside "
                                             r"the valid range \[0, 1\] for remote buffer 'remote_buffer_0' with "
                                             r"entries=2"):
            rt.run(lambda ctx: ops.remote_load(buf, 2))
        with pytest.raises(TypeError, match=r"offset must be an integer, got 1\.0"):
            rt.run(lambda ctx: ops.remote_load(buf, 1.0))  # type: ignore[arg-type]  # a wrong type, refused
        with pytest.raises(ValueError, match=r"offset=-1 is outside the valid range \[0, 1\]"):
            rt.run(lambda ctx: ops.remote_store(buf, -1, np.zeros(3, np.float32)))
        with pytest.raises(ValueError, match=r"value has shape \(4,\) but remote buffer 'remote_buffer_0' has slots "
                                             r"of shape \(3,\)"):
            rt.run(lambda ctx: ops.remote_store(buf, 0, np.zeros(4, np.float32)))
        with pytest.raises(TypeError, match="dtype float64 but remote buffer 'remote_buffer_0' holds float32"):
            rt.run(lambda ctx: ops.remote_store(buf, 0, np.zeros(3)))
        with pytest.raises(ValueError, match=r"entry 1 of remote buffer 'remote_buffer_0' holds no variable.*"
                                             r"entries with variables: \[0\]"):
            rt.run(lambda ctx: ops.remote_store(buf, 1, np.zeros(3, np.float32)))
        with pytest.raises(ValueError, match="entry 1 of remote buffer 'remote_buffer_0' holds no variable"):
            rt.run(lambda ctx: ops.remote_load(buf, 1))
        with pytest.raises(ValueError, match=r"entry 0 already holds variable 'x'; free entries: \[1\]"):
            rt.remote_variable(np.zeros(3, np.float32), buf, 0)
        with pytest.raises(ValueError, match=r"per-replica value has shape \(4,\) but remote buffer 'remote_buffer_0'"):
            rt.remote_variable(np.zeros(4, np.float32), buf, 1)
        with pytest.raises(ValueError, match=r"remote_variable 'remote_\d+': offset=5 is outside the valid range"):
            rt.remote_variable(np.zeros(3, np.float32), buf, 5)
        with pytest.raises(TypeError, match="cannot convert data of dtype complex128 to float32"):
            rt.remote_variable(np.zeros(3, complex), buf, 1)
        assert buf.free_entries() == [1]  # failed bindings leave the slot free
        with pytest.raises(ValueError, match=r"slots of shape \(3,\) but a shard of a tensor of shape \(30,\) "
                                             r"\(30 elements\) over 2 replica\(s\) has shape \(15,\)"):
            rt.remote_replica_sharded_variable(np.zeros(30, np.float32), buf, 1)
        foreign = other.remote_buffer((3,), np.float32)
        with pytest.raises(ValueError, match="not a remote buffer of this Runtime"):
            rt.run(lambda ctx: ops.remote_load(foreign, 0))
        with pytest.raises(ValueError, match="location='disk' is invalid"):
            rt.remote_buffer((3,), np.float32, location="disk")
        with pytest.raises(ValueError, match="only used with location='file'"):
            rt.remote_buffer((3,), np.float32, path="/tmp")
        with pytest.raises(ValueError, match="entries=0 is invalid: it must be an integer >= 1"):
            rt.remote_buffer((3,), np.float32, entries=0)
        with pytest.raises(TypeError, match="entries must be an integer"):
            rt.remote_buffer((3,), np.float32, entries=2.0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"shape\[1\]=-1 is invalid: it must be an integer >= 0"):
            rt.remote_buffer((3, -1), np.float32)
        with pytest.raises(RuntimeError, match="inside a step"):
            rt.run(lambda ctx: rt.remote_buffer((3,), np.float32))
        assert isinstance(buf, RemoteBuffer) and "entries=2" in repr(buf)
