"""examples/mnist_rts.py end to end: the same weights for every split of the same replicas (threads
in one process or instances under a real poprun), with RTS on or off, and across a resume."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import PYTHON, ROOT, poprun

sys.path.insert(0, str(ROOT / "examples"))

import mnist_rts
from mnist import datasets
from mnist.datasets import Replicas

from popdist_py.engine import Runtime

SCRIPT = str(ROOT / "examples" / "mnist_rts.py")
FINAL = re.compile(r"^(?:\[(\d+)\] )?final: test_accuracy=(\d\.\d{4}) weights_sha256=([0-9a-f]{64})$")
#: RTS (issue 5) is built after the replica engine; its tests run as soon as the engine has it.
HAS_RTS = all(hasattr(Runtime, name) for name in
              ("replica_sharded_variable", "remote_buffer", "remote_replica_sharded_variable"))
needs_rts = pytest.mark.skipif(
    not HAS_RTS, reason="popdist_py.engine has no replicated tensor sharding yet (issue 5)",
)


def run_inline(*argv: str) -> tuple[float, str]:
    """The example in this process: ``--replication-factor N`` replicas as threads of one Runtime."""
    accuracy, weights = mnist_rts.run(mnist_rts.parse_args(list(argv)))
    return float(f"{accuracy:.4f}"), weights  # as printed


def finals(stdout: str) -> dict[int, tuple[float, str]]:
    """instance -> (accuracy, hash) from the ``final:`` lines (untagged: instance 0)."""
    found = {}
    for line in stdout.splitlines():
        m = FINAL.match(line)
        if m:
            found[int(m.group(1) or 0)] = (float(m.group(2)), m.group(3))
    return found


def run_poprun(instances: int, replicas: int, *argv: str) -> tuple[tuple[float, str], subprocess.CompletedProcess[str]]:
    proc = poprun("--num-instances", str(instances), "--num-replicas", str(replicas), PYTHON, SCRIPT, *argv,
                  timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = finals(proc.stdout)
    assert sorted(results) == list(range(instances)), proc.stdout
    assert len(set(results.values())) == 1, f"instances disagree: {results}"
    return results[0], proc


# -- data feeding -----------------------------------------------------------------------------------


def instance_blocks(x: np.ndarray, y: np.ndarray, batch: int, total: int, local: int, epoch: int) -> list[np.ndarray]:
    """Every global batch as the replicas see it, ``[R, B, ...]``, reassembled from all instances."""
    parts = [list(datasets.train_batches(x, y, batch, Replicas(total, local, i * local), seed=3, epoch=epoch))
             for i in range(total // local)]
    return [np.concatenate([p[k][0] for p in parts]) for k in range(len(parts[0]))]


def test_every_split_feeds_the_same_global_batches() -> None:
    x = np.arange(101, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    y = np.arange(101)
    ref = instance_blocks(x, y, 8, 1, 1, epoch=2)  # R=1, B=8
    assert len(ref) == 101 // 8  # the last incomplete global batch is dropped
    for total, local, batch in ((2, 1, 4), (2, 2, 4), (4, 1, 2), (4, 2, 2), (4, 4, 2), (8, 4, 1)):
        got = instance_blocks(x, y, batch, total, local, epoch=2)
        assert [g.shape for g in got] == [(total, batch, 3)] * len(ref)
        for g, r in zip(got, ref, strict=True):
            np.testing.assert_array_equal(g.reshape(-1, 3), r.reshape(-1, 3))
    assert not np.array_equal(instance_blocks(x, y, 8, 1, 1, epoch=3)[0], ref[0])  # reshuffled per epoch


def test_test_batches_cover_the_test_set_once() -> None:
    x, y = np.arange(23, dtype=np.float32)[:, None], np.arange(23)
    for total, local in ((1, 1), (4, 2), (4, 4)):
        seen = []
        for i in range(total // local):
            for xb, yb, mask in datasets.eval_batches(x, y, 3, Replicas(total, local, i * local)):
                assert xb.shape == (local, 3, 1) and mask.shape == (local, 3)
                seen += list(yb[mask])
        assert sorted(seen) == list(range(23))


# -- training ----------------------------------------------------------------------------------------


@pytest.mark.slow  # trains MNIST
def test_defaults_reach_95_percent() -> None:
    accuracy, _ = run_inline()
    assert accuracy >= 0.95


@pytest.mark.slow  # trains MNIST
def test_replication_2x4_matches_1x8() -> None:
    one, _ = run_inline("--replication-factor", "1", "--batch-size", "8")
    two, _ = run_inline("--replication-factor", "2", "--batch-size", "4")
    assert one >= 0.95 and abs(one - two) <= 0.01, (one, two)


@pytest.mark.slow  # trains MNIST
def test_weights_reproducible_and_seeded() -> None:
    a = run_inline("--replication-factor", "2", "--epochs", "1")
    assert run_inline("--replication-factor", "2", "--epochs", "1") == a
    assert run_inline("--replication-factor", "2", "--epochs", "1", "--seed", "1")[1] != a[1]


@pytest.mark.slow  # trains MNIST, starts poprun
def test_poprun_splits_give_identical_weights() -> None:
    ref = run_inline("--replication-factor", "4", "--epochs", "2")
    two, proc = run_poprun(2, 4, "--epochs", "2", "--replication-factor", "1")
    assert two == ref
    assert "--replication-factor 1 is ignored under poprun" in proc.stdout + proc.stderr
    four, _ = run_poprun(4, 4, "--epochs", "2")
    assert four == ref


@pytest.mark.slow  # trains MNIST
@needs_rts
def test_rts_gives_identical_weights() -> None:
    ref = run_inline("--replication-factor", "4", "--epochs", "2")
    assert run_inline("--replication-factor", "4", "--epochs", "2", "--rts") == ref
    # 3 replicas: 64x64 and 64x10 do not split evenly, so the shards carry padding
    assert run_inline("--replication-factor", "3", "--epochs", "1", "--rts") == \
        run_inline("--replication-factor", "3", "--epochs", "1")


@pytest.mark.slow  # trains MNIST, starts poprun
@needs_rts
def test_rts_under_poprun_gives_identical_weights() -> None:
    ref = run_inline("--replication-factor", "4", "--epochs", "2")
    two, _ = run_poprun(2, 4, "--epochs", "2", "--rts")
    assert two == ref
    four, _ = run_poprun(4, 4, "--epochs", "2", "--rts")  # every shard in another process
    assert four == ref


@pytest.mark.slow  # trains MNIST, starts poprun
@needs_rts
def test_demo_command_matches_one_process() -> None:
    """``make demo``'s run: 2 instances x 2 replicas with RTS, default options, to the bits of 1 x 4 without."""
    ref = run_inline("--replication-factor", "4")
    demo, proc = run_poprun(2, 4, "--rts")
    assert demo == ref and ref[0] >= 0.95
    assert "RTS on" in proc.stdout + proc.stderr


# -- checkpoints ---------------------------------------------------------------------------------------


@pytest.mark.slow  # trains MNIST
def test_resume_gives_the_same_weights(tmp_path: Path) -> None:
    straight = run_inline("--replication-factor", "2", "--epochs", "2")
    ckpt = tmp_path / "ckpt.npz"
    first = run_inline("--replication-factor", "2", "--epochs", "1", "--checkpoint", str(ckpt))
    assert ckpt.exists() and first != straight
    assert run_inline("--replication-factor", "2", "--epochs", "2", "--checkpoint", str(ckpt)) == straight
    # nothing left to train: the checkpoint is only evaluated
    assert run_inline("--replication-factor", "2", "--epochs", "2", "--checkpoint", str(ckpt)) == straight
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.npz"]  # no temporary files left


@pytest.mark.slow  # trains MNIST, starts poprun
def test_resume_under_another_split(tmp_path: Path) -> None:
    """Saved by one process with 4 replicas, resumed by 2 poprun instances (with RTS when available)."""
    straight = run_inline("--replication-factor", "4", "--epochs", "2")
    ckpt = tmp_path / "ckpt.npz"
    run_inline("--replication-factor", "4", "--epochs", "1", "--checkpoint", str(ckpt))
    rts = ("--rts",) if HAS_RTS else ()
    resumed, proc = run_poprun(2, 4, "--epochs", "2", "--checkpoint", str(ckpt), *rts)
    assert resumed == straight
    assert "resumed from" in proc.stdout + proc.stderr


@pytest.mark.slow  # trains MNIST, starts the example
def test_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.npz"
    run_inline("--epochs", "1", "--hidden-size", "32", "--checkpoint", str(ckpt))
    proc = subprocess.run([PYTHON, SCRIPT, "--checkpoint", str(ckpt)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (f"checkpoint {ckpt} does not fit this runtime: 'W0' has shape (64, 32) in the checkpoint but "
            "(64, 64) here") in proc.stderr
    assert "another --hidden-size" in proc.stderr


@pytest.mark.slow  # starts the example
@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "--batch-size=0 is invalid"),
    (["--lr", "-1"], "--lr=-1.0 is invalid"),
    (["--batch-size", "2000"], "exceeds the 1438 training samples"),
])
def test_bad_options_exit_2(argv: list[str], message: str) -> None:
    proc = subprocess.run([PYTHON, SCRIPT, *argv], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow  # trains MNIST, in the example too
def test_cli_prints_final_line_last() -> None:
    proc = subprocess.run([PYTHON, SCRIPT, "--epochs", "1", "--replication-factor", "2"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert FINAL.match(last) and finals(last)[0] == run_inline("--epochs", "1", "--replication-factor", "2")
    assert "epoch 1/1" in proc.stderr  # progress on instance 0, through logging when stderr is no terminal
