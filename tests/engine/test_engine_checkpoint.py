"""Checkpoints: full host tensors that restore under any split, RTS or not; bad files rejected
with clear errors before anything changes; a crash during a save leaves the old file intact."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from popdist_py.engine import CheckpointError, CommGroup, Runtime, Variable, ops
from tests.helpers import PYTHON, ROOT, poprun, run

SCRIPT = str(ROOT / "tests" / "scripts" / "engine_checkpoint.py")
W = np.arange(1, 31, dtype=np.float32).reshape(5, 6) / 7
G = np.array([[1.0, 2.0], [3.0, 4.0]])  # two groups


def build(rt: Runtime, rts: bool, remote: bool = True) -> dict[str, Variable]:
    """The same named variables, stored as plain, sharded or remote variables."""
    R = rt.replication_factor
    halves = rt.replica_grouping(group_size=R // 2)
    out: dict[str, Variable] = {}
    if rts:
        out["w"], _ = rt.replica_sharded_variable(W, name="w")
        out["g"], _ = rt.replica_sharded_variable(G, replica_grouping=halves, name="g")
    else:
        out["w"] = rt.variable(W, name="w")
        out["g"] = rt.variable(G, replica_grouping=halves, name="g")
    if remote:
        shape = (ops.shard_size(12, R),) if rts else (3, 4)
        buf = rt.remote_buffer(shape, np.int32, entries=2, location="file" if rts else "memory")
        data = np.arange(12, dtype=np.int32).reshape(3, 4)
        out["r"] = (rt.remote_replica_sharded_variable(data, buf, 1, name="r") if rts
                    else rt.remote_variable(data, buf, 1, name="r"))
    out["c"] = rt.variable(np.int64(5), name="c")
    return out


def values(rt: Runtime) -> dict[str, np.ndarray]:
    return {v.name: rt.get_tensor_data(v) for v in rt.variables}


def perturb(rt: Runtime, vs: dict[str, Variable]) -> None:
    """Change every variable (as the owner of the data would) so a load has something to restore."""
    for v in vs.values():
        rt.write_variable_data(v, np.zeros(v.shape_on_host, v.dtype))


@pytest.mark.determinism
@pytest.mark.parametrize("saved_R, saved_rts", [(4, False), (4, True), (2, True)])
@pytest.mark.parametrize("loaded_R, loaded_rts", [(4, True), (2, False), (2, True), (8, True)])
def test_restores_under_other_splits(tmp_path: Path, saved_R: int, saved_rts: bool, loaded_R: int,
                                     loaded_rts: bool) -> None:
    path = tmp_path / "ck.npz"
    with Runtime(replication=saved_R) as rt:
        vs = build(rt, saved_rts)
        buf = vs["r"].remote_buffer
        rt.run(lambda ctx: ops.remote_store(buf, 1, ops.remote_load(buf, 1) + 1))
        saved = values(rt)
        rt.save(path, {"epoch": 7, "note": "x"})
    assert saved["r"].tolist() == (np.arange(12).reshape(3, 4) + 1).tolist()
    with Runtime(replication=loaded_R) as rt:
        vs = build(rt, loaded_rts)
        perturb(rt, vs)
        assert rt.load(path) == {"epoch": 7, "note": "x"}
        got = values(rt)
        assert got.keys() == saved.keys()
        for name in saved:
            assert got[name].dtype == saved[name].dtype and got[name].tobytes() == saved[name].tobytes(), name
        # the replicas really hold the loaded state (their shards, their slots)
        full = rt.run(lambda ctx: ops.replicated_all_gather(vs["w"]) if loaded_rts else ctx[vs["w"]])
        assert all(np.array_equal(f, W) for f in full)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.npz"]  # no temporary files left


def test_file_is_a_plain_npz_with_a_json_manifest(tmp_path: Path) -> None:
    path = tmp_path / "ck.npz"
    with Runtime(replication=4) as rt:
        build(rt, rts=True)
        rt.save(path)
    with np.load(path, allow_pickle=False) as data:
        manifest = json.loads(str(data["__manifest__"]))
        entries = {e["name"]: e for e in manifest["variables"]}
        assert np.array_equal(data[entries["w"]["key"]], W)  # the full tensor, padding removed
        assert np.array_equal(data[entries["g"]["key"]], G)
    assert manifest["format"] == "poprun-py engine checkpoint" and manifest["replication_factor"] == 4
    assert entries["w"]["sharded"] == {"shard_over": 4} and entries["r"]["remote"]["location"] == "file"
    assert entries["g"]["replica_grouping"] == {"num_replicas": 4, "stride": 1, "group_size": 2}
    assert oct(path.stat().st_mode & 0o777) != oct(0o600)  # not mkstemp's private mode


def test_all_replicas_variables_keep_diverged_replicas(tmp_path: Path) -> None:
    path = tmp_path / "ck.npz"
    with Runtime(replication=4) as rt:
        v = rt.variable(np.zeros((2, 2)), replica_grouping=rt.replica_grouping(group_size=2),
                        retrieval_mode="all_replicas", name="v")
        rt.run(lambda ctx: ctx.__setitem__(v, ctx[v] + ctx.replica_index))
        rt.save(path)
    with Runtime(replication=4) as rt:
        v = rt.variable(np.zeros((2, 2)), replica_grouping=rt.replica_grouping(group_size=2),
                        retrieval_mode="all_replicas", name="v")
        rt.load(path)
        assert rt.get_tensor_data(v)[:, 0].tolist() == [0, 1, 2, 3]
    with Runtime(replication=2) as rt:  # the replicas of a group differ: no sensible regrouping
        rt.variable(np.zeros((2, 2)), replica_grouping=rt.replica_grouping(group_size=1), name="v")
        with pytest.raises(CheckpointError, match="replicas 0 and 1 of its group 0 differ"):
            rt.load(path)


def test_mismatches_are_named_and_change_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ck.npz"
    with Runtime(replication=4) as rt:
        build(rt, rts=False, remote=False)
        rt.save(path)
    with Runtime(replication=4) as rt:
        rt.variable(np.zeros((6, 5), np.float32), name="w")  # transposed
        rt.variable(np.zeros((2, 2), np.float32), replica_grouping=rt.replica_grouping(group_size=2), name="g")
        rt.variable(np.int32(0), name="c")
        rt.variable(np.zeros(1), name="extra")
        before = values(rt)
        with pytest.raises(CheckpointError) as info:
            rt.load(path)
        msg = str(info.value)
        assert f"checkpoint {path} does not fit this runtime" in msg
        assert "missing from the checkpoint: 'extra'" in msg
        assert "'w' has shape (5, 6) in the checkpoint but (6, 5) here" in msg
        assert "'g' has dtype float64 in the checkpoint but float32 here" in msg
        assert "'c' has dtype int64 in the checkpoint but int32 here" in msg
        assert all(values(rt)[k].tobytes() == before[k].tobytes() for k in before)  # nothing was loaded
    with Runtime(replication=4) as rt:
        rt.variable(np.zeros((5, 6), np.float32), name="w")
        with pytest.raises(CheckpointError, match="in the checkpoint but not in this runtime: 'g', 'c'"):
            rt.load(path)
        rt.load(path, strict=False)
        assert np.array_equal(rt.get_tensor_data(rt.variables["w"]), W)
    with Runtime(replication=4) as rt:
        rt.variable(np.zeros((5, 6), np.float32), name="w")
        rt.variable(np.zeros((2, 2)), replica_grouping=rt.replica_grouping(stride=2), name="g")
        rt.variable(np.int64(0), name="c")
        saved = r"ReplicaGrouping\(num_replicas=4, stride=1, group_size=2, num_groups=2\)"
        with pytest.raises(CheckpointError, match=rf"'g' was saved with replica grouping {saved} but"):
            rt.load(path)
    with Runtime(replication=4) as rt:
        rt.variable(np.zeros((5, 6), np.float32), name="w")
        rt.variable(np.zeros(2), name="g")
        rt.variable(np.int64(0), name="c")
        with pytest.raises(CheckpointError, match=r"'g' has 2 replica group\(s\) in the checkpoint \(stride=1, "
                                                  r"group_size=2 of 4 replicas\) but 1 here"):
            rt.load(path)


def corrupt_copies(tmp_path: Path, good: Path) -> dict[str, Path]:
    raw = good.read_bytes()
    out = {}
    out["truncated"] = tmp_path / "truncated.npz"
    out["truncated"].write_bytes(raw[: len(raw) // 2])
    flipped = bytearray(raw)
    with zipfile.ZipFile(good) as zf:
        info = zf.getinfo("v0.npy")
    flipped[info.header_offset + 30 + len(info.filename) + 200] ^= 0xFF  # inside w's data
    out["flipped"] = tmp_path / "flipped.npz"
    out["flipped"].write_bytes(bytes(flipped))
    out["garbage"] = tmp_path / "garbage.npz"
    out["garbage"].write_bytes(b"not a zip file at all" * 10)
    out["plain"] = tmp_path / "plain.npz"
    np.savez(out["plain"], w=W)  # a valid npz, but not a checkpoint
    out["forged"] = tmp_path / "forged.npz"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(out["forged"], "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "__manifest__.npy":
                manifest = json.loads(str(np.load(good)["__manifest__"]))
                manifest["variables"][0]["host_shape"] = [6, 5]
                manifest["variables"][0]["shape"] = [6, 5]
                buf = io.BytesIO()
                np.save(buf, np.array(json.dumps(manifest)))
                data = buf.getvalue()
            dst.writestr(item, data)
    out["pickled"] = tmp_path / "pickled.npz"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(out["pickled"], "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "v0.npy":
                buf = io.BytesIO()
                np.save(buf, np.array([object()], dtype=object), allow_pickle=True)
                data = buf.getvalue()
            dst.writestr(item, data)
    return out


@pytest.mark.parametrize("kind, message", [
    ("truncated", "is not a readable checkpoint (truncated or corrupted?)"),
    ("flipped", "is corrupted: member 'v0.npy' fails its CRC check"),
    ("garbage", "is not a readable checkpoint (truncated or corrupted?)"),
    ("plain", "is not a poprun-py checkpoint: it has no __manifest__ member"),
    ("forged", "the data of variable 'w' has shape (5, 6) and dtype float32 but the manifest says (6, 5)"),
    ("pickled", "the data of variable 'w' has shape (1,) and dtype object"),
    ("missing", "no checkpoint at"),
])
def test_corrupted_checkpoints_are_rejected(tmp_path: Path, kind: str, message: str) -> None:
    good = tmp_path / "good.npz"
    with Runtime(replication=2) as rt:
        build(rt, rts=True, remote=False)
        rt.save(good)
    bad = corrupt_copies(tmp_path, good).get(kind, tmp_path / "missing.npz")
    with Runtime(replication=2) as rt:
        vs = build(rt, rts=True, remote=False)
        perturb(rt, vs)
        before = values(rt)
        with pytest.raises(CheckpointError) as info:
            rt.load(bad)
        assert message in str(info.value) and str(bad) in str(info.value)
        assert all(values(rt)[k].tobytes() == before[k].tobytes() for k in before)  # untouched
        rt.load(good)
        assert np.array_equal(rt.get_tensor_data(vs["w"]), W)


def test_save_errors_are_raised_and_leave_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ck.npz"
    with Runtime(replication=2) as rt:
        w = rt.variable(W, name="w")
        rt.save(path, {"v": 1})
        old = path.read_bytes()
        rt.write_variable_data(w, W * 2)
        with pytest.raises(TypeError, match="metadata must be JSON-serialisable"):
            rt.save(path, {"bad": object()})
        with pytest.raises(OSError, match="could not create a temporary file"):
            rt.save(tmp_path / "no" / "such" / "dir.npz")

        def failing_replace(src: str, dst: str) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "replace", failing_replace)
        with pytest.raises(OSError, match="No space left on device"):
            rt.save(path)
        monkeypatch.undo()
        assert path.read_bytes() == old and sorted(p.name for p in tmp_path.iterdir()) == ["ck.npz"]
        assert rt.load(path) == {"v": 1} and np.array_equal(rt.get_tensor_data(w), W)


@pytest.mark.slow  # starts processes
def test_killed_during_save_leaves_the_old_checkpoint(tmp_path: Path) -> None:
    """A real process is SIGKILLed while it writes a 300 MB checkpoint over a good one."""
    path = tmp_path / "ck.npz"
    first = run([PYTHON, SCRIPT, "--replicas", "2", "--rts", "--steps", "2", "--save", str(path)])
    assert first.returncode == 0, first.stderr
    good = path.read_bytes()
    expect = re.search(r"final-sha256 (\w+)", first.stdout).group(1)  # type: ignore[union-attr]
    (tmp_path / "spill").mkdir()  # POPDIST_REMOTE_DIR must exist
    for _attempt in range(3):
        proc = subprocess.Popen([PYTHON, SCRIPT, "--replicas", "2", "--rts", "--steps", "1", "--big-mb", "300",
                                 "--save", str(path)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                                env={**os.environ, "POPDIST_REMOTE_DIR": str(tmp_path / "spill")})
        killed = False
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                tmps = list(tmp_path.glob(".ck.npz.*.tmp"))
                if tmps and tmps[0].exists() and tmps[0].stat().st_size > 32 << 20:
                    proc.send_signal(signal.SIGKILL)
                    killed = True
                    break
                time.sleep(0.001)
        finally:
            if proc.poll() is None and not killed:
                proc.kill()
            proc.wait(timeout=30)
        if killed:
            break
        path.write_bytes(good)  # it finished first: try again
    assert killed and proc.returncode == -signal.SIGKILL
    leftover = list(tmp_path.glob(".ck.npz.*.tmp"))
    assert leftover and leftover[0].stat().st_size > 32 << 20  # it really was mid-write
    assert path.read_bytes() == good
    again = run([PYTHON, SCRIPT, "--replicas", "4", "--steps", "0", "--load", str(path)])
    assert again.returncode == 0, again.stderr
    assert f"loaded-sha256 {expect}" in again.stdout


@pytest.mark.slow  # starts processes
@pytest.mark.timeout(240)
def test_poprun_round_trip_between_splits(tmp_path: Path) -> None:
    """Saved by 1 x 4 replicas without RTS, resumed by 2 poprun instances x 2 with RTS (and back to 1 x 2):
    the resumed training gives the bits of an uninterrupted one."""
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    straight = run([PYTHON, SCRIPT, "--replicas", "4", "--steps", "6"])
    assert straight.returncode == 0, straight.stderr
    want = re.search(r"final-sha256 (\w+)", straight.stdout).group(1)  # type: ignore[union-attr]
    first = run([PYTHON, SCRIPT, "--replicas", "4", "--steps", "3", "--save", str(a)])
    assert first.returncode == 0, first.stderr
    saved = re.search(r"final-sha256 (\w+)", first.stdout).group(1)  # type: ignore[union-attr]
    resumed = poprun("--num-instances", "2", "--num-replicas", "4", PYTHON, SCRIPT, "--rts", "--steps", "3",
                     "--load", str(a), "--save", str(b), timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert re.findall(r"loaded-sha256 (\w+)", resumed.stdout) == [saved, saved]
    finals = re.findall(r"final-sha256 (\w+) replicas=4 instances=2", resumed.stdout)
    assert finals == [want, want]
    back = run([PYTHON, SCRIPT, "--replicas", "2", "--steps", "0", "--load", str(b)])
    assert back.returncode == 0, back.stderr
    assert re.search(r"loaded-sha256 (\w+)", back.stdout).group(1) == want  # type: ignore[union-attr]


def test_save_and_load_are_host_calls(tmp_path: Path) -> None:
    with Runtime(replication=2) as rt:
        rt.variable(np.zeros(1))
        with pytest.raises(RuntimeError, match="inside a step"):
            rt.run(lambda ctx: rt.save(tmp_path / "x.npz"))
        rt.close()
        with pytest.raises(RuntimeError, match="closed"):
            rt.save(tmp_path / "x.npz")


def test_sharded_over_consecutive_domain_round_trip(tmp_path: Path) -> None:
    with Runtime(replication=4) as rt:
        rt.replica_sharded_variable(W, shard_over=CommGroup.consecutive(2), name="w")
        rt.save(tmp_path / "ck.npz")
    with Runtime(replication=4) as rt:
        full, _shard = rt.replica_sharded_variable(np.zeros_like(W), name="w")
        rt.load(tmp_path / "ck.npz")
        assert np.array_equal(rt.get_tensor_data(full), W)
        assert rt.get_replica_data(full).shape == (4, 8)
