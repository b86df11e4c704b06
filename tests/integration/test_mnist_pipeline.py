"""examples/mnist_pipeline.py: the MNIST network in two pipeline stages trains bitwise as the same
stages one after the other (--no-pipeline) and as mnist_rts.py, with replication, under both
schedules and under a real poprun; --trace writes every op of the last step; bad device counts
are one line and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import PYTHON, ROOT, poprun
from tests.integration.mnist_output import finals

sys.path.insert(0, str(ROOT / "examples"))

import mnist_pipeline
import mnist_rts
from mnist import datasets, stages
from mnist.model import init_params, loss_and_grads

from popcontract.environment import NUM_IPUS_PER_REPLICA, NUM_LOCAL_REPLICAS, NUM_TOTAL_REPLICAS, REPLICA_INDEX_OFFSET
from popdist_py.engine.pipeline import GPIPE, ONE_F_ONE_B
from popdist_py.engine.pipeline.schedule import device_order

SCRIPT = str(ROOT / "examples" / "mnist_pipeline.py")
#: The issue's run: two devices per replica, 8 micro-batches per update, one short epoch.
BASE = ("--accumulation", "8", "--epochs", "1")

pytestmark = pytest.mark.timeout(120)


def run_inline(*argv: str) -> tuple[float, str]:
    """The example in this process (``--replication-factor N`` replicas as threads of one Runtime)."""
    accuracy, weights = mnist_pipeline.run(mnist_pipeline.parse_args(list(argv)))
    return float(f"{accuracy:.4f}"), weights  # as printed


# -- the stages ----------------------------------------------------------------------------------------


@pytest.mark.determinism
def test_the_stages_one_after_the_other_are_the_model_bitwise() -> None:
    """Loss and gradients of the two stages run in sequence are those of model.loss_and_grads."""
    data = datasets.load(None)
    params = init_params(data.input_size, 16, 10, seed=2)._asdict()
    x, y = data.train_x[8:16], data.train_y[8:16]
    loss, grads = stages.pipeline().sequential(params, x, y)
    expect_loss, expect = loss_and_grads(params, x, y)
    assert np.float32(loss).tobytes() == expect_loss.tobytes()
    assert sorted(grads) == sorted(expect._fields)
    assert all(grads[n].dtype == np.float32 and grads[n].tobytes() == getattr(expect, n).tobytes() for n in grads)


# -- training ----------------------------------------------------------------------------------------


@pytest.mark.determinism
@pytest.mark.slow  # trains MNIST
@pytest.mark.parametrize("replicas", ["1", "2"])
def test_pipelined_equals_no_pipeline_bitwise(replicas: str) -> None:
    """--ipus-per-replica 2 --accumulation 8 under either schedule: the weights (and so the final
    line) of the stages one after the other, and of mnist_rts.py's unsplit model."""
    argv = (*BASE, "--replication-factor", replicas)
    ref = run_inline(*argv, "--no-pipeline")
    assert run_inline(*argv, "--ipus-per-replica", "2") == ref
    assert run_inline(*argv, "--ipus-per-replica", "2", "--schedule", GPIPE) == ref
    accuracy, weights = mnist_rts.run(mnist_rts.parse_args(list(argv)))
    assert (float(f"{accuracy:.4f}"), weights) == ref
    assert ref[0] > 0.3  # it trained (chance is 0.10)


@pytest.mark.determinism
@pytest.mark.slow  # trains MNIST
def test_replicas_and_micro_batches_trade_bitwise() -> None:
    """The same global batch of 64 as 2 replicas x 8 micro-batches of 4 and 1 x 4 of 16."""
    two = run_inline("--epochs", "1", "--replication-factor", "2", "--accumulation", "8", "--batch-size", "4")
    assert run_inline("--epochs", "1", "--accumulation", "4", "--batch-size", "16") == two


@pytest.mark.slow  # trains MNIST
def test_trace_has_every_forward_and_backward_of_both_stages(tmp_path: Path) -> None:
    path = tmp_path / "step.json"
    run_inline(*BASE, "--replication-factor", "2", "--trace", str(path))
    doc = json.loads(path.read_text())
    ops = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] in ("forward", "backward")]
    assert len(ops) == 2 * 2 * 8 * 2  # replicas x stages x micro-batches x (forward, backward)
    for replica in (0, 1):
        for stage in (0, 1):
            mine = sorted((e for e in ops if e["pid"] == replica and e["args"]["stage"] == stage),
                          key=lambda e: e["ts"])
            assert {e["tid"] for e in mine} == {stage}  # stage k on device k
            ran = [(e["args"]["kind"], e["args"]["micro_batch"]) for e in mine]
            assert ran == [(op.kind, op.micro_batch) for op in device_order(ONE_F_ONE_B, stage, 2, 8)]
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert {"replica 0", "replica 1", "device 0", "device 1"} <= names


@pytest.mark.slow  # trains MNIST, starts poprun
def test_under_poprun_equals_one_process_without_pipeline(tmp_path: Path) -> None:
    """2 instances x 2 replicas x 2 devices: bitwise 4 replicas in one process without a pipeline;
    instance 0 writes one trace with the ops of all 4 replicas."""
    ref = run_inline(*BASE, "--replication-factor", "4", "--no-pipeline")
    trace = tmp_path / "step.json"
    proc = poprun("--num-instances", "2", "--num-replicas", "4", "--ipus-per-replica", "2", PYTHON, SCRIPT, *BASE,
                  "--trace", str(trace), timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = finals(proc.stdout)
    assert results == {0: ref, 1: ref}, proc.stdout
    assert "pipeline on 2 device(s) per replica, 1f1b schedule" in proc.stdout + proc.stderr
    ops = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["tid"], e["cat"]) for e in ops} == {
        (r, d, kind) for r in range(4) for d in (0, 1) for kind in ("forward", "backward")} | {
        (r, 0, "input") for r in range(4)} | {(r, 1, "output") for r in range(4)}
    assert len(ops) == 4 * 8 * (2 * 2 + 2)  # replicas x micro-batches x (stages x 2 + the host exchanges)


# -- bad flags ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--ipus-per-replica", "1"], ("--ipus-per-replica=1 is too few: the model's 2 pipeline stages need 2 devices "
                                   "per replica; give --ipus-per-replica 2 or more, or run them on one device with "
                                   "--no-pipeline")),
    (["--ipus-per-replica", "0", "--no-pipeline"], "--ipus-per-replica=0 is invalid: it must be >= 1"),
    (["--schedule", "zigzag"], "argument --schedule: invalid choice: 'zigzag'"),
    (["--accumulation", "0"], "--accumulation=0 is invalid: it must be >= 1"),
    (["--trace", "t.json", "--no-pipeline"],
     "--trace records the pipeline's timeline; there is none with --no-pipeline"),
])
def test_bad_flags_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        mnist_pipeline.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"{mnist_rts.Parser().prog}: error: {message}"), err


def test_devices_come_from_poprun_and_must_agree(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert mnist_pipeline.parse_args([]).devices == 2  # without poprun: one device per stage
    assert mnist_pipeline.parse_args(["--ipus-per-replica", "1", "--no-pipeline"]).devices == 1
    for name, value in ((NUM_TOTAL_REPLICAS, "2"), (NUM_LOCAL_REPLICAS, "2"), (REPLICA_INDEX_OFFSET, "0"),
                        (NUM_IPUS_PER_REPLICA, "4")):
        monkeypatch.setenv(name, value)  # as poprun --num-replicas 2 --ipus-per-replica 4 sets them
    assert mnist_pipeline.parse_args([]).devices == 4
    assert mnist_pipeline.parse_args(["--ipus-per-replica", "4"]).devices == 4
    with pytest.raises(SystemExit):
        mnist_pipeline.parse_args(["--ipus-per-replica", "2"])
    assert "--ipus-per-replica=2 does not match poprun's --ipus-per-replica 4" in capsys.readouterr().err
    monkeypatch.setenv(NUM_IPUS_PER_REPLICA, "1")  # poprun's default
    with pytest.raises(SystemExit):
        mnist_pipeline.parse_args([])
    assert ("poprun's --ipus-per-replica 1 is too few: the model's 2 pipeline stages need 2 devices per replica; "
            "run poprun with --ipus-per-replica 2") in capsys.readouterr().err
    assert mnist_pipeline.parse_args(["--no-pipeline"]).devices == 1


@pytest.mark.slow  # starts the example
def test_too_few_devices_exit_2_with_one_line() -> None:
    proc = subprocess.run([PYTHON, SCRIPT, "--ipus-per-replica", "1"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [(
        "mnist_pipeline.py: error: --ipus-per-replica=1 is too few: the model's 2 pipeline stages need 2 devices per "
        "replica; give --ipus-per-replica 2 or more, or run them on one device with --no-pipeline (see --help)")]


@pytest.mark.slow  # trains MNIST, in the example too
def test_cli_prints_final_line_last() -> None:
    proc = subprocess.run([PYTHON, SCRIPT, *BASE, "--replication-factor", "2"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert finals(last) == {0: run_inline(*BASE, "--replication-factor", "2", "--no-pipeline")}
