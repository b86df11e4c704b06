"""examples/mnist_rts.py end to end: the same weights for every split of the same replicas (threads
in one process or instances under a real poprun), every --shard/--offchip setting, accumulated
micro-batches against one batch, and across a resume; each optimizer trains."""

from __future__ import annotations

import functools
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
from mnist.model import init_params, loss_and_grads
from mnist.trainer import LEVELS, OPTIMIZERS, training_options

from popdist_py.engine import TensorStorage, TileSet, canonical_sum
from tests.integration.mnist_output import FINAL, finals

SCRIPT = str(ROOT / "examples" / "mnist_rts.py")
#: ``make demo``'s options (the Makefile's demo line), run there by 2 instances x 2 replicas.
DEMO = ("--optimizer", "adam", "--shard", "weights", "--offchip", "optimizer")


def run_inline(*argv: str) -> tuple[float, str]:
    """The example in this process: ``--replication-factor N`` replicas as threads of one Runtime."""
    accuracy, weights = mnist_rts.run(mnist_rts.parse_args(list(argv)))
    return float(f"{accuracy:.4f}"), weights  # as printed


@functools.cache
def reference(*argv: str) -> tuple[float, str]:
    """``run_inline(*argv)`` once per test process, for the tests that compare other runs with it
    (each run's own reproducibility is ``test_weights_reproducible_and_seeded``'s)."""
    return run_inline(*argv)


def run_poprun(instances: int, replicas: int, *argv: str) -> tuple[tuple[float, str], subprocess.CompletedProcess[str]]:
    proc = poprun("--num-instances", str(instances), "--num-replicas", str(replicas), PYTHON, SCRIPT, *argv,
                  timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = finals(proc.stdout)
    assert sorted(results) == list(range(instances)), proc.stdout
    assert len(set(results.values())) == 1, f"instances disagree: {results}"
    return results[0], proc


# -- data feeding -----------------------------------------------------------------------------------


def instance_blocks(x: np.ndarray, y: np.ndarray, batch: int, total: int, local: int, epoch: int,
                    accumulation: int = 1) -> list[np.ndarray]:
    """Every global batch in the order replicas and micro-batches take it, ``[R, A, B, ...]``,
    reassembled from all instances' ``[A, L, B, ...]``."""
    parts = [list(datasets.train_batches(x, y, batch, Replicas(total, local, i * local), seed=3, epoch=epoch,
                                         accumulation=accumulation))
             for i in range(total // local)]
    for p in parts:
        assert all(xb.shape == (accumulation, local, batch, *x.shape[1:]) for xb, _ in p)
    return [np.concatenate([p[k][0].swapaxes(0, 1) for p in parts]) for k in range(len(parts[0]))]


def test_every_split_feeds_the_same_global_batches() -> None:
    """R replicas of B, A micro-batches of B and any split into instances see the global batches
    of one replica of R x A x B, in the same order."""
    x = np.arange(101, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    y = np.arange(101)
    ref = instance_blocks(x, y, 8, 1, 1, epoch=2)  # R=1, B=8
    assert len(ref) == 101 // 8  # the last incomplete global batch is dropped
    for total, local, batch, acc in ((2, 1, 4, 1), (2, 2, 4, 1), (4, 1, 2, 1), (4, 2, 2, 1), (4, 4, 2, 1),
                                     (8, 4, 1, 1), (1, 1, 4, 2), (1, 1, 2, 4), (2, 1, 2, 2), (2, 2, 1, 4),
                                     (4, 2, 1, 2)):
        got = instance_blocks(x, y, batch, total, local, epoch=2, accumulation=acc)
        assert [g.shape for g in got] == [(total, acc, batch, 3)] * len(ref)
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


# -- the model and the options -------------------------------------------------------------------


@pytest.mark.determinism
def test_micro_batch_gradients_add_up_bitwise() -> None:
    """The gradient of 8 samples is bitwise the pairwise sum of the gradients of its micro-batches
    divided by their count, for micro-batches of 4, 2 and 1: what makes accumulation exact."""
    data = datasets.load(None)
    p = init_params(data.input_size, 16, 10, seed=1)
    x, y = data.train_x[40:48], data.train_y[40:48]
    _, whole = loss_and_grads(p, x, y)
    for b in (4, 2, 1):
        parts = [loss_and_grads(dict(p._asdict()), x[k:k + b], y[k:k + b])[1] for k in range(0, 8, b)]
        for name, g in whole._asdict().items():
            together = canonical_sum(np.stack([getattr(q, name) for q in parts])) / np.float32(8 // b)
            assert g.dtype == np.float32 and np.array_equal(g, together), (b, name)


@pytest.mark.determinism
def test_a_sample_does_not_depend_on_its_batch() -> None:
    """Each sample's loss is the same bits alone, in a batch, and in a batch of another layout."""
    data = datasets.load(None)
    p = init_params(data.input_size, 64, 10, seed=0)
    x, y = data.train_x[:32], data.train_y[:32]
    alone = [loss_and_grads(p, x[k:k + 1], y[k:k + 1]) for k in range(32)]
    loss, grads = loss_and_grads(p, np.asfortranarray(x), y)
    assert loss == canonical_sum(np.array([a[0] for a in alone])) / np.float32(32)
    assert all(np.array_equal(g, canonical_sum(np.stack([a[1][i] for a in alone])) / np.float32(32))
               for i, g in enumerate(grads))


@pytest.mark.parametrize("level", LEVELS)
def test_flags_map_to_location_settings(level: str) -> None:
    """--shard and --offchip set PopART's settings of their class, and 'weights' includes the state."""
    classes = {"none": (), "optimizer": ("optimizer_state",), "weights": ("optimizer_state", "weight")}[level]
    sharded = training_options(3, level, "none")
    off = training_options(1, "none", level)
    assert sharded.accumulation_factor == 3 and sharded.reduction == "mean"
    for kind in ("weight", "optimizer_state", "accumulator"):
        s = getattr(sharded, f"{kind}_tensor_location_settings").location
        o = getattr(off, f"{kind}_tensor_location_settings").location
        assert s.replicated_tensor_sharding is (kind in classes) and s.storage is TensorStorage.ON_CHIP
        assert (o.storage, o.load_tile_set) == ((TensorStorage.OFF_CHIP, TileSet.IO) if kind in classes else
                                                (TensorStorage.ON_CHIP, TileSet.COMPUTE))
        assert not o.replicated_tensor_sharding


@pytest.mark.parametrize("argv, message", [
    (["--optimizer", "rmsprop"], "argument --optimizer: invalid choice: 'rmsprop'"),
    (["--shard", "all"], "argument --shard: invalid choice: 'all'"),
    (["--offchip", "yes"], "argument --offchip: invalid choice: 'yes'"),
    (["--accumulation", "0"], "--accumulation=0 is invalid: it must be >= 1"),
    (["--accumulation", "two"], "argument --accumulation: invalid int value: 'two'"),
    (["--lr", "nan"], "--lr=nan is invalid: it must be a finite number > 0"),
    (["--rts", "--shard", "optimizer"], "--rts means --shard weights; it contradicts --shard optimizer"),
    (["--rts", "--shard", "none"], "--rts means --shard weights; it contradicts --shard none"),
])
def test_bad_flags_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        mnist_rts.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"{mnist_rts.Parser().prog}: error: {message}"), err


def test_rts_is_shard_weights() -> None:
    assert mnist_rts.parse_args(["--rts"]).shard == "weights"
    assert mnist_rts.parse_args(["--rts", "--shard", "weights"]).shard == "weights"
    assert mnist_rts.parse_args([]).shard == "none"


# -- training ----------------------------------------------------------------------------------------


@pytest.mark.slow  # trains MNIST
def test_defaults_reach_95_percent() -> None:
    accuracy, _ = run_inline()
    assert accuracy >= 0.95


@pytest.mark.slow  # trains MNIST
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_each_optimizer_trains(optimizer: str) -> None:
    """Each optimizer with its default learning rate learns the digits (chance is 0.10)."""
    accuracy, _ = run_inline("--optimizer", optimizer, "--replication-factor", "2", "--batch-size", "4")
    assert accuracy >= 0.95, (optimizer, accuracy)


@pytest.mark.determinism
@pytest.mark.slow  # trains MNIST
def test_every_split_of_8_samples_gives_one_hash() -> None:
    """The seed's check (2 replicas of 4 against 1 of 8, approximately) holds bitwise for every
    split down to one sample per replica: the mean over R replicas of 8 / R samples is the
    pairwise tree of the 8 samples divided by 8, because a sample's activations come from
    ``matmul`` (the same bits alone or in a batch) and its gradients add up in the same tree.
    Compared over 2 epochs (358 steps; 8 replicas of one sample each take 13 s for the default 10
    on 2 cores, and the test runs again under each OpenBLAS kernel): a step that differs differs
    in its weights from then on. The default 10 epochs reach 95% in one process."""
    assert run_inline("--replication-factor", "1", "--batch-size", "8")[0] >= 0.95
    one = run_inline("--replication-factor", "1", "--batch-size", "8", "--epochs", "2")
    for replicas, batch in [("2", "4"), ("4", "2"), ("8", "1")]:
        assert run_inline("--replication-factor", replicas, "--batch-size", batch, "--epochs", "2") == one, \
            (replicas, batch)


@pytest.mark.determinism
@pytest.mark.slow  # trains MNIST
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_accumulation_equals_one_batch_bitwise(optimizer: str) -> None:
    """A micro-batches of B are bitwise one batch of A x B (B a power of two), with replicas too."""
    for replicas in ("1", "2"):
        one = run_inline("--optimizer", optimizer, "--replication-factor", replicas, "--epochs", "2",
                         "--batch-size", "8")
        assert run_inline("--optimizer", optimizer, "--replication-factor", replicas, "--epochs", "2",
                          "--batch-size", "4", "--accumulation", "2") == one
        assert run_inline("--optimizer", optimizer, "--replication-factor", replicas, "--epochs", "2",
                          "--batch-size", "2", "--accumulation", "4") == one


@pytest.mark.slow  # trains MNIST
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "lamb"])
def test_every_location_setting_gives_identical_weights(optimizer: str) -> None:
    """Every --shard x --offchip setting, 4 replicas in one process: bitwise the replicated weights.
    SGD has no state (its weights follow --shard weights alone); LAMB needs norms across shards."""
    base = ("--optimizer", optimizer, "--replication-factor", "4", "--epochs", "1")
    ref = run_inline(*base)
    for shard in LEVELS:
        for offchip in LEVELS:
            assert run_inline(*base, "--shard", shard, "--offchip", offchip) == ref, (shard, offchip)


@pytest.mark.slow  # trains MNIST
def test_location_settings_with_uneven_shards() -> None:
    """3 replicas: 64x64, 64 and 64x10 do not split evenly, so the shards carry padding."""
    base = ("--optimizer", "adam", "--replication-factor", "3", "--epochs", "1", "--accumulation", "2")
    ref = run_inline(*base)
    for shard, offchip in (("optimizer", "none"), ("weights", "none"), ("weights", "weights")):
        assert run_inline(*base, "--shard", shard, "--offchip", offchip) == ref, (shard, offchip)


@pytest.mark.slow  # trains MNIST
def test_weights_reproducible_and_seeded() -> None:
    a = run_inline("--replication-factor", "2", "--epochs", "1")
    assert run_inline("--replication-factor", "2", "--epochs", "1") == a
    assert run_inline("--replication-factor", "2", "--epochs", "1", "--seed", "1")[1] != a[1]


@pytest.mark.slow  # trains MNIST, starts poprun
def test_poprun_splits_give_identical_weights() -> None:
    ref = reference("--replication-factor", "4", "--epochs", "2")
    two, proc = run_poprun(2, 4, "--epochs", "2", "--replication-factor", "1")
    assert two == ref
    assert "--replication-factor 1 is ignored under poprun" in proc.stdout + proc.stderr
    four, _ = run_poprun(4, 4, "--epochs", "2")
    assert four == ref


@pytest.mark.slow  # trains MNIST
def test_rts_gives_identical_weights() -> None:
    """--rts, the seed's flag, is --shard weights."""
    ref = reference("--replication-factor", "4", "--epochs", "2")
    assert run_inline("--replication-factor", "4", "--epochs", "2", "--rts") == ref


@pytest.mark.slow  # trains MNIST, starts poprun
def test_rts_under_poprun_gives_identical_weights() -> None:
    ref = reference("--replication-factor", "4", "--epochs", "2")
    two, _ = run_poprun(2, 4, "--epochs", "2", "--rts")
    assert two == ref
    four, _ = run_poprun(4, 4, "--epochs", "2", "--rts")  # every shard in another process
    assert four == ref


@pytest.mark.slow  # trains MNIST, starts poprun
@pytest.mark.parametrize("argv", [
    ("--optimizer", "lamb", "--shard", "optimizer", "--offchip", "weights"),
    ("--optimizer", "momentum", "--shard", "weights", "--offchip", "weights", "--accumulation", "2"),
])
def test_location_settings_under_poprun_match_one_process(argv: tuple[str, ...]) -> None:
    """2 instances x 2 replicas and 4 x 1 with sharded and off-chip tensors (shards in other
    processes): bitwise 4 replicas in one process with everything replicated on chip."""
    plain = [a for a in argv if a not in ("--shard", "--offchip", "optimizer", "weights")]
    ref = run_inline("--replication-factor", "4", "--epochs", "2", *plain)
    two, _ = run_poprun(2, 4, "--epochs", "2", *argv)
    assert two == ref
    four, _ = run_poprun(4, 4, "--epochs", "2", *argv)
    assert four == ref


@pytest.mark.slow  # trains MNIST, starts poprun
def test_demo_command_matches_one_process() -> None:
    """``make demo``'s run: 2 instances x 2 replicas, Adam, weights sharded and their state sharded
    off chip, default options otherwise: bitwise 1 x 4 with everything replicated on chip."""
    ref = run_inline("--replication-factor", "4", "--optimizer", "adam")
    demo, proc = run_poprun(2, 4, *DEMO)
    assert demo == ref and ref[0] >= 0.95
    assert "RTS on (--shard weights), off chip: optimizer" in proc.stdout + proc.stderr
    makefile = (ROOT / "Makefile").read_text()
    assert "--num-instances 2 --num-replicas 4 $(PY) examples/mnist_rts.py " + " ".join(DEMO) in makefile


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


@pytest.mark.slow  # trains MNIST
def test_resume_keeps_optimizer_state(tmp_path: Path) -> None:
    """Adam's moments and update count come back: a resume under other location settings and
    another accumulation split (same global batch) ends bitwise where a straight run does."""
    base = ("--optimizer", "adam", "--replication-factor", "4", "--batch-size", "4", "--accumulation", "2")
    straight = run_inline(*base, "--epochs", "2")
    ckpt = tmp_path / "ckpt.npz"
    run_inline(*base, "--epochs", "1", "--checkpoint", str(ckpt), "--shard", "optimizer", "--offchip", "optimizer")
    resumed = run_inline("--optimizer", "adam", "--replication-factor", "4", "--batch-size", "8", "--epochs", "2",
                         "--checkpoint", str(ckpt), "--shard", "weights", "--offchip", "weights")
    assert resumed == straight


@pytest.mark.slow  # trains MNIST, starts poprun
def test_resume_under_another_split(tmp_path: Path) -> None:
    """Saved by one process with 4 replicas, resumed by 2 poprun instances with sharded weights."""
    straight = run_inline("--replication-factor", "4", "--epochs", "2", "--optimizer", "momentum")
    ckpt = tmp_path / "ckpt.npz"
    run_inline("--replication-factor", "4", "--epochs", "1", "--optimizer", "momentum", "--checkpoint", str(ckpt))
    resumed, proc = run_poprun(2, 4, "--epochs", "2", "--optimizer", "momentum", "--checkpoint", str(ckpt), "--rts",
                               "--offchip", "optimizer")
    assert resumed == straight
    assert "resumed from" in proc.stdout + proc.stderr


@pytest.mark.slow  # trains MNIST, starts the example
def test_checkpoint_of_another_optimizer_is_refused(tmp_path: Path) -> None:
    """Adam and LAMB keep state of the same names and shapes: the recorded optimizer tells them apart."""
    ckpt = tmp_path / "ckpt.npz"
    run_inline("--epochs", "1", "--optimizer", "adam", "--checkpoint", str(ckpt))
    proc = subprocess.run([PYTHON, SCRIPT, "--optimizer", "lamb", "--checkpoint", str(ckpt)], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{ckpt} was saved with --optimizer adam, not lamb" in proc.stderr
    proc = subprocess.run([PYTHON, SCRIPT, "--optimizer", "sgd", "--checkpoint", str(ckpt)], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "in the checkpoint but not in this runtime: 'W0/exp_avg'" in proc.stderr
    assert "another --hidden-size, --optimizer or dataset" in proc.stderr


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
    (["--optimizer", "rmsprop"], "invalid choice: 'rmsprop'"),
    (["--shard", "optimizer", "--rts"], "--rts means --shard weights"),
    (["--batch-size", "2000"], "exceeds the 1438 training samples"),
    (["--batch-size", "200", "--accumulation", "8"],
     "global batch of 1600 samples (--batch-size 200 x --accumulation 8 x 1 replicas) exceeds the 1438"),
])
def test_bad_options_exit_2(argv: list[str], message: str) -> None:
    proc = subprocess.run([PYTHON, SCRIPT, *argv], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr  # one line, no usage


@pytest.mark.slow  # trains MNIST, in the example too
def test_cli_prints_final_line_last() -> None:
    proc = subprocess.run([PYTHON, SCRIPT, "--epochs", "1", "--replication-factor", "2"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert FINAL.match(last) and finals(last)[0] == run_inline("--epochs", "1", "--replication-factor", "2")
    assert "epoch 1/1" in proc.stderr  # progress on instance 0, through logging when stderr is no terminal
