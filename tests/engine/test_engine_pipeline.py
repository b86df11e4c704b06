"""Pipelining in one process: schedules, a Trainer over pipelined stages bitwise equal to the same
stages run one after the other, devices on cores of their own, the step's trace, and errors
(bad stage layouts before anything runs, a failing stage named, never a hang)."""

from __future__ import annotations

import itertools
import json
import os
import threading
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

from popdist_py.engine import PipelineStageError, Runtime, Trainer, TrainingOptions
from popdist_py.engine.optimizers import SGD, Adam
from popdist_py.engine.pipeline import GPIPE, ONE_F_ONE_B, Pipeline, Stage, bubble, ideal_bubble
from popdist_py.engine.pipeline.schedule import BACKWARD, FORWARD, Op, device_order, in_flight
from popdist_py.engine.pipeline.stash import Stash
from popdist_py.engine.pipeline.sync import timeline
from tests.engine.pipeline_model import SAMPLES, SIZES, STEPS, X, Y, batch, init, layer_stage, mlp


def train(model: Any, replicas: int, accumulation: int, opts: TrainingOptions | None = None,
          steps: int = STEPS) -> tuple[dict[str, np.ndarray], np.ndarray, Trainer]:
    micro = SAMPLES // (replicas * accumulation)
    opts = opts or TrainingOptions(accumulation_factor=accumulation)
    with Runtime(replication=replicas) as rt:
        trainer = Trainer(rt, init(), model, Adam(0.01), [(micro, SIZES[0]), (micro, SIZES[-1])], opts)
        with trainer:
            losses = [trainer.step(batch(X[s], replicas, accumulation), batch(Y[s], replicas, accumulation))
                      for s in range(steps)]
            return trainer.weights(), np.concatenate(losses), trainer


# ------------------------------------------------------------------------------------------ schedules
@pytest.mark.one_executor  # no Runtime
@pytest.mark.parametrize("K,M", [(1, 1), (2, 1), (2, 8), (3, 2), (4, 16)])
def test_schedules_run_every_op_once_in_micro_batch_order(K: int, M: int) -> None:
    for schedule in (ONE_F_ONE_B, GPIPE):
        for s in range(K):
            order = device_order(schedule, s, K, M)
            every = [*((FORWARD, s, m) for m in range(M)), *((BACKWARD, s, m) for m in range(M))]
            assert sorted(order) == sorted(every)
            for kind in (FORWARD, BACKWARD):
                assert [op.micro_batch for op in order if op.kind == kind] == list(range(M))
            # a backward never comes before its own forward
            assert all(order.index(Op(FORWARD, s, op.micro_batch)) < i
                       for i, op in enumerate(order) if op.kind == BACKWARD)
            stash = in_flight(order)
            assert stash == (M if schedule == GPIPE else min(K - s, M))
    assert ideal_bubble(2, 16) == pytest.approx(1 / 17)


# ------------------------------------------------------------------------------------------ training
@pytest.mark.parametrize("schedule", [ONE_F_ONE_B, GPIPE])
@pytest.mark.parametrize("replicas,accumulation", [(1, 8), (2, 4), (1, 1)])
def test_pipelined_training_equals_the_stages_one_after_the_other(schedule: str, replicas: int,
                                                                  accumulation: int) -> None:
    pipe = mlp(schedule=schedule)
    expect, expect_losses, _ = train(pipe.sequential, replicas, accumulation)
    got, losses, _ = train(pipe, replicas, accumulation)
    assert all(got[n].tobytes() == expect[n].tobytes() for n in expect)
    assert losses.tobytes() == expect_losses.tobytes()
    assert not np.array_equal(got["W0"], init()["W0"])  # it trained


@pytest.mark.determinism
def test_pipelines_keep_the_bits_under_location_settings_and_across_splits_of_devices() -> None:
    opts = TrainingOptions(accumulation_factor=4)
    opts.optimizer_state_tensor_location_settings.location.replicated_tensor_sharding = True
    opts.weight_tensor_location_settings.location.storage = "off_chip"
    opts.accumulator_tensor_location_settings.location.storage = "off_chip"
    expect, _, _ = train(mlp().sequential, 2, 4)
    for pipe in (mlp(), mlp(devices=4, placement=(3, 1, 0)), two_stages()):
        got, _, _ = train(pipe, 2, 4, opts)
        assert all(got[n].tobytes() == expect[n].tobytes() for n in expect)


def test_devices_run_on_cores_of_their_own_where_there_are_enough() -> None:
    cores = len(os.sched_getaffinity(0))
    seen: dict[int, set[int]] = {}

    def spy(stage: Stage) -> Stage:
        def forward(params: Any, carry: Any, *mb: Any) -> Any:
            seen[stage.device] = os.sched_getaffinity(0)  # this thread's mask
            return stage.forward(params, carry, *mb)

        return Stage(forward, stage.backward, stage.device, stage.weights, stage.name)

    pipe = Pipeline([spy(stage) for stage in two_stages().stages], 2)
    train(pipe, 1, 4, steps=1)
    if cores >= 2:  # one core each, not the same
        assert len(seen[0]) == len(seen[1]) == 1 and seen[0] != seen[1]
    else:
        assert seen[0] == seen[1]


def two_stages() -> Pipeline:
    """Layer 0 on device 0, layers 1 and 2 as one stage on device 1."""
    return Pipeline([layer_stage(0, False, 0), Stage(*_two_layers_last())], 2)


def _two_layers_last() -> tuple[Any, Any, int, tuple[str, ...]]:
    """Layers 1 and 2 of the MLP as one stage (forward, backward, device placeholder, weights)."""
    one, two = layer_stage(1, False, 0), layer_stage(2, True, 0)

    def forward(params: Any, carry: Any, x: Any, y: Any) -> tuple[Any, Any]:
        a, s1 = one.forward(params, carry, x, y)
        loss, s2 = two.forward(params, a, x, y)
        return loss, (s1, s2)

    def backward(params: Any, saved: Any, grad_out: Any) -> tuple[Any, dict[str, Any]]:
        s1, s2 = saved
        da, g2 = two.backward(params, s2, None)  # type: ignore[misc]
        dh, g1 = one.backward(params, s1, da)  # type: ignore[misc]
        return dh, {**g1, **g2}

    return forward, backward, 1, ("W1", "b1", "W2", "b2")


# ------------------------------------------------------------------------------------------ the trace
def test_a_step_trace_is_chrome_json_with_every_op_in_schedule_order(tmp_path: Path) -> None:
    pipe = mlp()
    with Runtime(replication=2) as rt, Trainer(rt, init(), pipe, SGD(0.1), [(4, SIZES[0]), (4, SIZES[-1])],
                                               TrainingOptions(accumulation_factor=4)) as trainer:
        trainer.step(batch(X[0], 2, 4), batch(Y[0], 2, 4))
        path = tmp_path / "step.json"
        pipe.write_trace(path)
    doc = json.loads(path.read_text())
    ops = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] in ("forward", "backward")]
    assert len(ops) == 2 * 3 * 4 * 2  # replicas x stages x micro-batches x (forward, backward)
    exchanges = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] in ("input", "output")]
    expected = [(r, f"{k[0].upper()}{m}", 0 if k == "input" else 2)  # feeds on device 0, outputs on device 2
                for r in (0, 1) for k in ("input", "output") for m in range(4)]
    assert sorted((e["pid"], e["name"], e["tid"]) for e in exchanges) == sorted(expected)
    for replica in (0, 1):
        for stage in range(3):
            mine = sorted((e for e in ops if e["pid"] == replica and e["args"]["stage"] == stage),
                          key=lambda e: e["ts"])
            assert {e["tid"] for e in mine} == {stage}  # stage k on device k
            ran = [(e["args"]["kind"], e["args"]["micro_batch"]) for e in mine]
            assert ran == [(op.kind, op.micro_batch) for op in device_order(ONE_F_ONE_B, stage, 3, 4)]
            assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in itertools.pairwise(mine))  # one at a time
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert {"replica 0", "replica 1", "device 0", "device 2"} <= names
    assert 0.0 <= bubble(pipe.events[0]) < 1.0


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.one_executor  # no Runtime
@pytest.mark.parametrize("make,message", [
    (lambda: mlp(devices=2), r"3 pipeline stages need 3 devices per replica, but a replica has 2"),
    (lambda: mlp(placement=(0, 3, 1)), r"stage 1 \(layer 1\): device=3 is outside the valid range \[0, 2\]"),
    (lambda: mlp(placement=(0, 1, 1)), r"stage 2 \(layer 2\) and stage 1 \(layer 1\) are both on device 1"),
    (lambda: Pipeline([layer_stage(0, False, 0), Stage(layer_stage(1, False, 1).forward, None, 1, ("W1",))], 2),
     r"stage 1 has no backward, but training needs it \(for weights 'W1'\)"),
    (lambda: Pipeline([layer_stage(0, False, 0), Stage(layer_stage(1, False, 1).forward, None, 1)], 2),
     r"stage 1 has no backward, but training needs it \(for weights 'W0', 'b0'\)"),
    (lambda: Pipeline([layer_stage(0, False, 0), layer_stage(0, True, 1)], 2),
     r"weight 'W0' belongs to stage 0 \(layer 0\) and stage 1 \(layer 0\)"),
    (lambda: mlp(schedule="zigzag"), r"schedule='zigzag' is not one of 1f1b, gpipe"),
    (lambda: Pipeline([], 2), "a pipeline needs at least one stage"),
])
def test_bad_stage_layouts_are_one_clear_error(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_a_pipeline_must_own_exactly_the_trainers_weights() -> None:
    two = Pipeline([layer_stage(0, False, 0), layer_stage(1, True, 1)], 2)  # no W2, b2
    with Runtime(replication=1) as rt:
        with pytest.raises(ValueError, match=r"weights 'W2', 'b2' belong to no stage"):
            Trainer(rt, init(), two, SGD(0.1), [(4, SIZES[0]), (4, SIZES[-1])])
        assert len(rt.variables) == 0
    with Runtime(replication=2) as rt:  # (one replica shards nothing)
        opts = TrainingOptions(accumulation_factor=2)
        opts.optimizer_state_tensor_location_settings.location.replicated_tensor_sharding = True
        opts.accumulator_tensor_location_settings.location.replicated_tensor_sharding = True
        with pytest.raises(ValueError, match=r"accumulators of 'W0', 'b0', .* are sharded, which a pipeline does"):
            Trainer(rt, init(), mlp(), Adam(0.1), [(4, SIZES[0]), (4, SIZES[-1])], opts)


@pytest.mark.parametrize("pattern", ["single_pipeline", "full"])
def test_a_failing_stage_ends_the_step_naming_replica_stage_and_micro_batch(pattern: str) -> None:
    """Layer 1's backward raises on one micro-batch of one replica (marked in its input); under
    full, the other replica's devices wait for it at host exchanges and are let go."""
    stages = mlp().stages
    layer = stages[1]
    mark = np.float32(1234.0)

    def forward(params: Any, carry: Any, x: np.ndarray, y: np.ndarray) -> Any:
        out, saved = layer.forward(params, carry, x, y)
        return out, (saved, bool(x[0, 0] == mark))

    def backward(params: Any, saved: Any, grad_out: Any) -> Any:
        saved, marked = saved
        if marked:
            raise FloatingPointError("overflow in layer 1")
        return layer.backward(params, saved, grad_out)  # type: ignore[misc]

    pipe = Pipeline([stages[0], Stage(forward, backward, 1, layer.weights, "layer 1"), stages[2]], 3,
                    sync_pattern=pattern)
    x, y = batch(X[0], 2, 4).copy(), batch(Y[0], 2, 4)
    x[2, 1, 0, 0] = mark  # micro-batch 2 of replica 1
    with Runtime(replication=2) as rt, Trainer(rt, init(), pipe, SGD(0.1), [(4, SIZES[0]), (4, SIZES[-1])],
                                               TrainingOptions(accumulation_factor=4)) as trainer:
        message = (r"replica 1: stage 1 \(layer 1\) \(device 1\) failed in the backward of micro-batch 2: "
                   r"FloatingPointError: overflow in layer 1")
        with pytest.raises(PipelineStageError, match=message):
            trainer.step(x, y)
        assert trainer.updates == 0  # the step ended on every replica before any update
        x[2, 1, 0, 0] = 0.0
        trainer.step(x, y)  # the runtime and the devices go on
        assert trainer.updates == 1


# ------------------------------------------------------------------------------------------ sync patterns
@pytest.mark.parametrize("pattern,inputs,outputs", [
    ("full", {0, 1, 2, 3, -1}, {0, 1, 2, 3}),  # -1: the host, which feeds inside the input exchange
    ("SinglePipeline", {0}, {3}),  # PopART's spelling
    ("replica_and_ladder", {0, 2}, {1, 3}),
])
def test_sync_patterns_decide_who_waits_at_each_host_exchange(pattern: str, inputs: set[int],
                                                              outputs: set[int]) -> None:
    """Ordering evidence, not timing: each exchange records the devices it waited for and their
    arrival tickets, all before its completion ticket; the feed ran once per micro-batch, on the
    host thread (inside the exchange under full, ahead of it otherwise)."""
    fed: list[int] = []

    def feed(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        fed.append(threading.get_native_id())
        return x * np.float32(1), y  # the host's work on the micro-batch (a copy)

    layers = (6, 8, 8, 8, 3)
    stages = [layer_stage(k, k == 3, k) for k in range(4)]
    pipe = Pipeline(stages, 4, sync_pattern=pattern, feed=feed)
    sequential = Pipeline(stages, 4)
    x, y = batch(X[0], 1, 8), batch(Y[0], 1, 8)
    results = []
    for model in (pipe, sequential.sequential):
        with Runtime(replication=1) as rt, Trainer(rt, init(layers), model, SGD(0.1),
                                                   [(4, SIZES[0]), (4, SIZES[-1])],
                                                   TrainingOptions(accumulation_factor=8)) as trainer:
            trainer.step(x, y)
            results.append(trainer.weights())
    assert all(results[0][n].tobytes() == results[1][n].tobytes() for n in results[1])  # the same bits
    records = pipe.exchanges[0]
    assert len(records) == 16 and len(fed) == 8 and len(set(fed)) == 1  # on the host thread
    for r in records:
        assert set(r.waited_for) == {(0, d) for d in (inputs if r.kind == "input" else outputs)}, r
        assert all(t < r.done for t in r.waited_for.values())
    assert sorted(r.micro_batch for r in records if r.kind == "input") == list(range(8))


def test_under_full_every_replica_meets_when_the_replicas_run_at_once(executor: str) -> None:
    """Two replicas: with the threads executor an input exchange waits for every device of both;
    with the cooperative one (replicas one after another) each replica's devices meet alone."""
    pipe = mlp(sync_pattern="full")
    train(pipe, 2, 4, steps=1)
    replicas = {0, 1} if executor == "threads" else None
    for local in (0, 1):
        records = pipe.exchanges[local]
        assert len(records) == 8
        for r in records:
            expect = {(rep, d) for rep in (replicas or {local}) for d in range(3)}
            assert set(r.waited_for) == expect and all(t < r.done for t in r.waited_for.values())


@pytest.mark.one_executor  # no Runtime
def test_bad_sync_patterns_and_feeds_are_named() -> None:
    with pytest.raises(ValueError, match=r"sync_pattern='ladder' is not one of full, single_pipeline, "
                                         r"replica_and_ladder"):
        Pipeline(mlp().stages, 3, sync_pattern="ladder")
    with pytest.raises(TypeError, match=r"feed must be callable"):
        Pipeline(mlp().stages, 3, feed=3)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ continuous
def test_without_accumulation_the_pipeline_runs_continuously_with_stale_weights(
        caplog: pytest.LogCaptureFixture) -> None:
    """Batches of one micro-batch flow through without a flush; each stage updates after each of
    its backwards. Checked against a one-thread reference that runs every op in the timeline's
    order and a stage's update right after its backward."""
    B, micro = 8, 4
    pipe = two_stages()
    x, y = X[0][:B * micro].reshape(B, micro, -1), Y[0][:B * micro].reshape(B, micro, -1)
    shapes = [(micro, SIZES[0]), (micro, SIZES[-1])]
    with caplog.at_level("WARNING", logger="popdist_py.engine._training.training"), Runtime(replication=1) as rt, \
            Trainer(rt, init(), pipe, SGD(0.1), shapes, TrainingOptions(accumulation_factor=1)) as trainer:
        losses = trainer.step(x, y)
        got = trainer.weights()
        assert trainer.continuous and trainer.updates == B and losses.shape == (B,)
    warned = [r.getMessage() for r in caplog.records if "stale weights" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0] and "accumulation_factor > 1" in warned[0]

    expect, opt = init(), SGD(0.1)
    state = {n: opt.init_state(w.shape, w.dtype) for n, w in expect.items()}
    orders = pipe.orders(B)
    updates = pipe.update_order(B)
    start, _ = timeline(orders)
    saved: dict[tuple[int, int], Any] = {}
    carry: dict[tuple[int | str, int], Any] = {}  # (stage, m) forward, ("back", m) backward
    ref_losses = [0.0] * B
    for op in sorted((op for order in orders for op in order), key=lambda op: (start[op], op.stage)):
        stage, m = pipe.stages[op.stage], op.micro_batch
        if op.kind == FORWARD:
            out, saved[op.stage, m] = stage.forward(expect, carry.pop((op.stage, m), None), x[m], y[m])
            if op.stage == 0:
                carry[1, m] = out
            else:
                ref_losses[m] = out
        else:
            grad_out = carry.pop(("back", m)) if op.stage == 0 else None
            dh, grads = stage.backward(expect, saved.pop((op.stage, m)), grad_out)  # type: ignore[misc]
            if op.stage == 1:
                carry["back", m] = dh
            assert (op.stage, m) in updates
            for n in stage.weights:
                opt.update(expect[n], grads[n].astype(np.float32), state[n], m + 1)
    assert all(got[n].tobytes() == expect[n].tobytes() for n in expect)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    with Runtime(replication=1) as rt, Trainer(rt, init(), pipe.sequential, SGD(0.1),
                                               [(micro, SIZES[0]), (micro, SIZES[-1])]) as trainer:
        trainer.step(x, y)  # the same 8 updates without pipelining: fresh weights every time
        fresh = trainer.weights()
    assert not np.allclose(got["W0"], fresh["W0"], rtol=1e-6)  # the stale weights made a difference
    np.testing.assert_allclose(got["W0"], fresh["W0"], atol=0.02)  # a small one


def test_a_pipeline_with_accumulation_does_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="popdist_py.engine._training.training"):
        _, _, trainer = train(mlp(), 1, 2, steps=1)
    assert not trainer.continuous and not [r for r in caplog.records if "stale" in r.getMessage()]


# ------------------------------------------------------------------------------------------ the stash
class Saved(NamedTuple):
    h: np.ndarray
    tag: str


def rss_shmem() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssShmem:"))


@pytest.mark.one_executor  # no Runtime
def test_an_off_chip_stash_keeps_values_out_of_resident_memory_and_gives_them_back() -> None:
    big = np.arange(16 << 20, dtype=np.float32)  # 64 MiB
    small = np.arange(3, dtype=np.float64)
    stash = Stash(off_chip=True, min_elements=8)
    before = rss_shmem()
    stash.put(5, (big, [small, {"k": big[:10].reshape(2, 5)}], Saved(big[:100], "x"), 7))
    assert rss_shmem() - before < (1 << 20)  # the 64 MiB copy is not resident
    assert stash.spilled_bytes() >= big.nbytes + 100 * 4 and len(stash) == 1
    got = stash.pop(5)
    assert got[0].tobytes() == big.tobytes() and got[1][0] is small  # small arrays stay as they are
    assert got[1][1]["k"].tolist() == big[:10].reshape(2, 5).tolist() and got[3] == 7
    assert isinstance(got[2], Saved) and got[2].tag == "x" and got[2].h.tobytes() == big[:100].tobytes()
    held = stash.spilled_bytes()
    stash.put(6, (big[:5],))  # reuses the mapping: nothing new
    assert stash.spilled_bytes() == held
    on_chip = Stash()
    on_chip.put(0, (big,))
    assert on_chip.pop(0)[0] is big


@pytest.mark.determinism
@pytest.mark.parametrize("schedule", [ONE_F_ONE_B, GPIPE])
def test_off_chip_activations_keep_the_bits(schedule: str) -> None:
    opts = TrainingOptions(accumulation_factor=8)
    opts.activation_tensor_location_settings.location.storage = "off_chip"
    expect, _, _ = train(mlp(schedule=schedule), 1, 8)
    pipe = mlp(schedule=schedule)
    got, _, _ = train(pipe, 1, 8, opts)
    assert all(got[n].tobytes() == expect[n].tobytes() for n in expect)
    assert pipe.stash(0, 0).spilled_bytes() > 0 and pipe.stash(0, 2).spilled_bytes() > 0


def test_sharded_activations_are_refused() -> None:
    opts = TrainingOptions(accumulation_factor=2)
    opts.activation_tensor_location_settings.location.replicated_tensor_sharding = True
    with Runtime(replication=2) as rt, pytest.raises(ValueError, match=r"activation_tensor_location_settings.location: "
                                                     r"replicated_tensor_sharding is not supported for activations"):
        Trainer(rt, init(), mlp(), SGD(0.1), [(4, SIZES[0]), (4, SIZES[-1])], opts)


@pytest.mark.parametrize("pattern", ["full", "single_pipeline"])
def test_a_failing_feed_ends_the_step_naming_the_host_and_micro_batch(pattern: str) -> None:
    def feed(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if x[0, 0] == np.float32(99.0):
            raise OSError("the data file went away")
        return x, y

    pipe = Pipeline(mlp().stages, 3, sync_pattern=pattern, feed=feed)
    x, y = batch(X[0], 1, 4).copy(), batch(Y[0], 1, 4)
    x[2, 0, 0, 0] = 99.0
    with Runtime(replication=1) as rt, Trainer(rt, init(), pipe, SGD(0.1), [(8, SIZES[0]), (8, SIZES[-1])],
                                               TrainingOptions(accumulation_factor=4)) as trainer:
        with pytest.raises(PipelineStageError, match=r"replica 0: the host's feed of micro-batch 2 failed: "
                                                     r"OSError: the data file went away"):
            trainer.step(x, y)
        assert trainer.updates == 0
